"""How far pagedllm's greedy tokens on a real Gemma 3 270M Q4_K_M file follow transformers'.

For each kernel level this machine runs (PAGEDLLM_ISA), in a child process: the file under the
default settings (its Q4_K / Q6_K / Q8_0 matrices on the integer kernels, which round activations
to int8 or int16 per block; Q5_0 on its kernel too) and pagedllm's float path on it
(quantization=None: every matrix dequantized at load). Then, per prompt, against transformers'
Gemma3ForCausalLM in float32 on the same weights dequantized (tests/gemma3_real_file.py): the
tokens agreeing before the first divergence, the reference's logit gap there (its own top token
over ours), and the kernels' noise on the agreed steps (logprob of our token, and the logit
difference of our top two, against the reference's).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/gemma3_270m_agreement/agreement.py

writes results.json and results.md beside this script (the lock is taken by the caller).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests"))

from gemma3_real_file import (  # noqa: E402
    NEAR_TIE,
    NEW_TOKENS,
    PROMPTS,
    agreement,
    assemble,
    hf_reference,
    reference_logits,
)

COMMAND = "flock /tmp/pagedllm-bench.lock python3 benchmarks/results/gemma3_270m_agreement/agreement.py"


def run_level(gguf_path: str) -> dict:
    """pagedllm's greedy tokens (and top-2 logprobs, native) at this process's PAGEDLLM_ISA."""
    from pagedllm import LLM, SamplingParams

    out: dict = {}
    for name, quantization in (("native", "auto"), ("float", None)):
        t = time.perf_counter()
        llm = LLM(model=gguf_path, quantization=quantization)
        load_s = time.perf_counter() - t
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
        t = time.perf_counter()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        out[name] = {
            "load_s": round(load_s, 1),
            "generate_s": round(time.perf_counter() - t, 1),
            "prompt_ids": [o.prompt_token_ids for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[{str(t): p.logprob for t, p in s.items()} for s in o.outputs[0].logprobs] for o in outs],
        }
        del llm
    from pagedllm.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    out["compiled_isa"] = kernels.compiled_isa() if kernels is not None else "none"
    return out


def noise(logits, run: dict, i: int, agreed: int) -> tuple[float, float, float]:
    """On the agreed steps: the largest |our logprob - the reference's| of our token, and of the
    logit difference of our top two tokens (what decides a near-tie): on all steps, and on those
    whose reference margin is under 1 (the error grows with the difference)."""
    import torch

    logp = torch.log_softmax(logits, dim=-1)
    lp_err = diff_err = close_err = 0.0
    for step in range(agreed):
        ours = {int(k): v for k, v in run["logprobs"][i][step].items()}
        tok = run["tokens"][i][step]
        lp_err = max(lp_err, abs(ours[tok] - logp[step, tok].item()))
        a, b = sorted(ours, key=ours.get, reverse=True)[:2]
        ref = (logits[step, a] - logits[step, b]).item()
        err = abs((ours[a] - ours[b]) - ref)
        diff_err = max(diff_err, err)
        if abs(ref) < 1.0:
            close_err = max(close_err, err)
    return lp_err, diff_err, close_err


def analyse(gguf_path: str, levels: dict[str, dict]) -> dict:
    t = time.perf_counter()
    hf = hf_reference(gguf_path)
    results = {"reference_build_s": round(time.perf_counter() - t, 1), "levels": {}}
    for level, runs in levels.items():
        rows = []
        for i, prompt in enumerate(PROMPTS):
            native, flt = runs["native"], runs["float"]
            ids = native["prompt_ids"][i]
            logits = reference_logits(hf, ids, native["tokens"][i])
            a = agreement(logits, native["tokens"][i], NEAR_TIE)
            f = agreement(reference_logits(hf, ids, flt["tokens"][i]), flt["tokens"][i], NEAR_TIE)
            lp_err, diff_err, close_err = noise(logits, native, i, a.agreed)
            rows.append(
                {
                    "prompt": prompt,
                    "native_agreed": a.agreed,
                    "native_gap": a.gap,
                    "reference_first_near_tie": a.first_near_tie,
                    "reference_min_margin_before_divergence": min(a.margins[: a.agreed], default=None),
                    "native_max_logprob_error": lp_err,
                    "native_max_top2_difference_error": diff_err,
                    "native_max_top2_difference_error_margin_under_1": close_err,
                    "native_tokens": native["tokens"][i],
                    "float_agreed": f.agreed,
                    "float_gap": f.gap,
                    "float_tokens": flt["tokens"][i],
                }
            )
        timing = {f"{k}_{m}": runs[k][m] for k in ("native", "float") for m in ("load_s", "generate_s")}
        results["levels"][level] = {"compiled_isa": runs["compiled_isa"], **timing, "prompts": rows}
    return results


def cpu_facts() -> dict:
    from pagedllm.kernels.build import cpu_flags

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        from pagedllm.kernels.build import cpu_model

        model = cpu_model()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or "vnni" in f or f in ("avx2", "fma"))
    return {"cpu": model, "flags": flags, "cores": os.cpu_count()}


def write_markdown(results: dict) -> None:
    lines = [
        "# Gemma 3 270M Q4_K_M (a real download): greedy agreement with transformers",
        "",
        f"{len(PROMPTS)} raw-text prompts, {NEW_TOKENS} greedy tokens each, default engine settings "
        "(`LLM(model=file)`: Q4_K / Q6_K / Q8_0 / Q5_0 on the integer kernels, nothing dequantized) and "
        "the float path (`quantization=None`), against transformers' Gemma3ForCausalLM (float32) on the "
        "file dequantized. *agreed*: tokens equal before the first divergence; *gap*: the reference's "
        "logit of its own token minus that of ours at the divergence; *near-tie*: the reference's first "
        f"step whose top-2 logits are under {NEAR_TIE} apart; errors: the largest over the agreed steps.",
        f"Made by `{COMMAND}`.",
        "",
        f"CPU: {results['cpu']} ({results['cores']} cores), flags: {', '.join(results['flags']) or 'none'}. "
        f"Reference built in {results['reference_build_s']} s.",
    ]
    for level, run in results["levels"].items():
        lines += [
            "",
            f"## PAGEDLLM_ISA={level} ({run['compiled_isa']})",
            "",
            f"Load {run['native_load_s']} s native, {run['float_load_s']} s float (the float conversion "
            f"included); {NEW_TOKENS} tokens x {len(PROMPTS)}: {run['native_generate_s']} s native, "
            f"{run['float_generate_s']} s float.",
            "",
            "| prompt | native agreed | gap | near-tie | logprob error | top-2 difference error "
            "(margin < 1) | float agreed |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in run["prompts"]:
            gap = "-" if r["native_gap"] is None else f"{r['native_gap']:.4f}"
            lines.append(
                f"| {json.dumps(r['prompt'])} | {r['native_agreed']} | {gap} | {r['reference_first_near_tie']} | "
                f"{r['native_max_logprob_error']:.4f} | {r['native_max_top2_difference_error']:.4f} "
                f"({r['native_max_top2_difference_error_margin_under_1']:.4f}) | "
                f"{r['float_agreed']} |"
            )
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    from pagedllm.kernels.build import levels_here

    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(levels_here()), help="PAGEDLLM_ISA levels to run")
    parser.add_argument("--child", nargs=2, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with open(args.child[1], "w") as f:
            json.dump(run_level(args.child[0]), f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # the engine's conversions (the float path's is ~1 GB) go with the folder
        env = dict(os.environ, PAGEDLLM_CACHE_DIR=os.path.join(tmp, "cache"))
        os.environ["PAGEDLLM_CACHE_DIR"] = env["PAGEDLLM_CACHE_DIR"]
        gguf_path = assemble(tmp)
        levels = {}
        for level in args.levels.split(","):
            out = os.path.join(tmp, f"{level}.json")
            child = [sys.executable, __file__, "--child", gguf_path, out]
            subprocess.run(child, env={**env, "PAGEDLLM_ISA": level}, check=True)
            with open(out) as f:
                levels[level] = json.load(f)
        results = {**cpu_facts(), "command": COMMAND, **analyse(gguf_path, levels)}
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    write_markdown(results)
    print(open(os.path.join(HERE, "results.md")).read())


if __name__ == "__main__":
    main()
