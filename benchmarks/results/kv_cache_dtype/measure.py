"""kv_cache_dtype side by side: float32 vs bfloat16 vs float16 (the "auto" cache of GGUF models) vs
float8 (e4m3, e5m2: vLLM's fp8 caches, unscaled) vs int8 (float32 scales per token and KV head:
one per head up to 64 values, else per 32).

Parts (each alone under the benchmark lock; the caller takes it):
  capacity    KV bytes per token and blocks per GiB, default model, Gemma 3 270M, the 1.7B shape;
  attention   paged_decode_attention alone, 16 sequences x 8192 tokens of context, the 1.7B
              shape's heads (32 query / 32 KV heads of 64), median ms per call of 8,
              the dtypes taken in turn, the caches on huge pages as the engine's;
  attention-wide  the same with 16 query / 8 KV heads of 256 (Gemma 3's head_dim, the same bytes
              per token: int8 scaled per 32 values rather than per head);
  perplexity  `bench perplexity` (KJV Romans, context 512) of the default model (Q4_1 native)
              and of the Gemma 3 270M Q4_K_M file, per KV dtype, and without compiled kernels
              (float activations: how much the activation rounding alone moves it);
  throughput  `bench throughput`, GGUF file of --gguf (a 1.7B-shape Q4_K_M), a fixed KV budget
              (--kv-gib), --num-prompts x (150 + 128), every request submitted at once,
              output tok/s and preemptions per KV dtype (--rounds N: N rounds of the dtypes in
              turn, medians of the figures and of the within-round ratios).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_cache_dtype/measure.py \
        capacity attention perplexity [throughput --gguf FILE [--rounds N]] [--kv-dtypes float32,int8]

writes results.json, results.md and results.png beside this script (with the CPU recorded).
--kv-dtypes (float32 first) limits perplexity and throughput to those caches; such a run is kept
beside the full one, as "PART (dtype+dtype)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
TEXT = os.path.join(ROOT, "benchmarks", "data", "kjv-romans.txt")
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")


def torch_dtype(name: str):
    import torch

    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(name) or getattr(torch, name)


def as_cache(t, dtype):
    """A float cache tensor in ``dtype`` as the engine stores it: on transparent huge pages where
    the machine has them (runner/kv_cache.py; with 4 KiB pages every scattered block is a TLB miss
    of its own, and an int8 block's scales one more); int8 quantized, its scales attached."""
    import torch

    from pagedllm.attention import int8_kv
    from pagedllm.host_memory import copy_to_huge_pages

    parts = list(int8_kv.quantize(t)) if dtype == torch.int8 else [t.to(dtype)]
    parts = copy_to_huge_pages(parts) or parts
    if dtype == torch.int8:
        int8_kv.attach_scales(*parts)
    return parts[0]


def cache_bytes(cache) -> int:
    from pagedllm.attention.int8_kv import cache_scales

    scales = cache_scales(cache)
    return cache.numel() * cache.element_size() + (0 if scales is None else scales.numel() * 4)


def machine() -> dict:
    flags = set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    wanted = sorted(f for f in flags if f in ("avx2", "fma", "f16c", "avx_vnni", "amx_bf16") or f.startswith("avx512"))
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "flags": wanted}


def capacity() -> dict:
    from pagedllm.runner.kv_cache import GIB, kv_bytes_per_block

    shapes = {  # layers, KV heads, head_dim
        "smollm2-135m (default model)": (30, 3, 64),
        "gemma3-270m": (18, 1, 256),
        "smollm2-1.7b shape": (24, 32, 64),
    }
    rows = []
    for name, (layers, heads, dim) in shapes.items():
        for dtype in map(torch_dtype, KV_DTYPES):
            per_block = kv_bytes_per_block(layers, 16, heads, dim, dtype)
            rows.append(
                {
                    "model": name,
                    "kv_dtype": str(dtype).removeprefix("torch."),
                    "bytes_per_token": per_block // 16,
                    "blocks_per_gib": GIB // per_block,
                }
            )
    return {"rows": rows}


def attention(heads: int = 32, kv_heads: int = 32, dim: int = 64) -> dict:
    import torch

    from pagedllm.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    seqs, ctx, bs = 16, 8192, 16
    blocks_per_seq = ctx // bs
    g = torch.Generator().manual_seed(0)
    k = torch.randn(seqs * blocks_per_seq, kv_heads, bs, dim, generator=g)
    v = torch.randn(seqs * blocks_per_seq, kv_heads, bs, dim, generator=g)
    tables = torch.randperm(seqs * blocks_per_seq, generator=g).view(seqs, blocks_per_seq)
    lens = torch.full((seqs,), ctx, dtype=torch.long)
    q = torch.randn(seqs, heads, dim, generator=g)
    # Round-robin over the dtypes, 9 rounds (a warm-up and the median of the other 8): a busy
    # spell of the shared machine then slows every dtype alike instead of one of them.
    caches = [(as_cache(k, dtype), as_cache(v, dtype)) for dtype in map(torch_dtype, KV_DTYPES)]
    out = torch.empty_like(q)
    times: list[list[float]] = [[] for _ in caches]
    for _ in range(9):
        for (kc, vc), ts in zip(caches, times, strict=True):
            t = time.perf_counter()
            kernels.paged_decode_attention(out, q, kc, vc, tables, lens, 0.125)
            ts.append(time.perf_counter() - t)
    rows = []
    for (kc, vc), ts in zip(caches, times, strict=True):
        ms = 1000 * statistics.median(ts[1:])
        name = str(kc.dtype).removeprefix("torch.")
        read = cache_bytes(kc) + cache_bytes(vc)
        rows.append({"kv_dtype": name, "ms": round(ms, 2), "GB_per_s": round(read / ms / 1e6, 1)})
    base, base16 = rows[0]["ms"], rows[KV_DTYPES.index("float16")]["ms"]
    for r in rows:
        r["speedup_vs_float32"] = round(base / r["ms"], 2)
        r["speedup_vs_float16"] = round(base16 / r["ms"], 2)
    return {
        "shape": {"seqs": seqs, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim},
        "isa": kernels.compiled_isa(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", *args]


def perplexity(kv_dtypes: list[str]) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gemma3_real_file import assemble

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"smollm2-135m-instruct (Q4_1)": "smollm2-135m-instruct", "gemma3-270m (Q4_K_M)": assemble(tmp)}
        for name, model in models.items():
            # the last: attention_backend "torch" runs no compiled kernel at all, so the GGUF
            # layers dequantize and multiply in float: the float-activation run, which shows how
            # far the int8 / int16 activation rounding alone already moves this model
            runs = [(kv, "auto") for kv in kv_dtypes] + (
                [("float32", "torch")] if list(kv_dtypes) == list(KV_DTYPES) else []
            )
            for kv, backend in runs:
                out = os.path.join(tmp, "ppl.json")
                cmd = ["bench", "perplexity", "--model", model, "--text", TEXT, "--context", "512"]
                cmd += ["--kv-cache-dtype", kv, "--attention-backend", backend, "--output-json", out]
                subprocess.run(_cli(cmd), check=True)
                with open(out) as fh:
                    res = json.load(fh)
                kind = res["kv_cache_dtype"] + (" (no kernels: float activations)" if backend == "torch" else "")
                rows.append({"model": name, "kv_dtype": kind, "ppl": res["ppl"], "chunks": res["chunks"]})
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["kv_dtype"] == "float32")
        r["vs_float32_pct"] = round(100 * (r["ppl"] / base["ppl"] - 1), 4)
    return {"text": "benchmarks/data/kjv-romans.txt", "context": 512, "rows": rows}


def throughput_once(gguf: str, kv_gib: float, num_prompts: int, kv: str) -> dict:
    """One `bench throughput` run of ``gguf`` with a ``kv`` cache of ``kv_gib``, in a process of its own."""
    cmd = ["bench", "throughput", "--model", gguf, "--workload", "fixed", "--input-len", "150"]
    cmd += ["--output-len", "128", "--num-prompts", str(num_prompts), "--repeats", "1", "--no-save"]
    cmd += ["--kv-cache-memory-gib", str(kv_gib), "--max-num-seqs", str(num_prompts), "--kv-cache-dtype", kv]
    out = subprocess.run(_cli(cmd), check=True, capture_output=True, text=True).stdout
    res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    return {
        "kv_dtype": res["kv_cache_dtype"],
        "output_tok_s": res["output_tok_s"],
        "wall_s": res["wall_s"],
        "num_preemptions": res["num_preemptions"],
        "kv_cache_tokens": res["kv_cache_tokens"],
    }


def throughput(gguf: str, kv_gib: float, num_prompts: int, kv_dtypes: list[str], rounds: int) -> dict:
    """``rounds`` rounds of every dtype in turn (the machine's speed drifts by tens of percent over
    minutes: a ratio is taken within a round, and the result is the median of each)."""
    per_round = []
    for _ in range(rounds):
        rows = [throughput_once(gguf, kv_gib, num_prompts, kv) for kv in kv_dtypes]
        for r in rows:
            r["vs_float32"] = round(r["output_tok_s"] / rows[0]["output_tok_s"], 3)
        per_round.append(rows)
    medians = []
    for i, first in enumerate(per_round[0]):
        runs = [rows[i] for rows in per_round]
        medians.append(
            {
                "kv_dtype": first["kv_dtype"],
                "output_tok_s": round(statistics.median(r["output_tok_s"] for r in runs), 2),
                "num_preemptions": statistics.median(r["num_preemptions"] for r in runs),
                "kv_cache_tokens": first["kv_cache_tokens"],
                "vs_float32": round(statistics.median(r["vs_float32"] for r in runs), 2),
                "vs_float32_rounds": [r["vs_float32"] for r in runs],
            }
        )
    out = {"model": os.path.basename(gguf), "kv_gib": kv_gib, "num_prompts": num_prompts, "rows": medians}
    if rounds > 1:
        out["rounds"] = per_round
    return out


def markdown(results: dict) -> str:
    lines = ["# kv_cache_dtype: float32 vs bfloat16 vs float16 vs float8 vs int8 KV caches", ""]
    m = results.get("machine", {})
    lines += [f"Machine: {m.get('cpu')}, {m.get('cores')} cores, flags {' '.join(m.get('flags', []))}.", ""]
    lines += ["Command:", "", "```", results.get("command", ""), "```", ""]
    for part, data in results.items():
        if part in ("machine", "command") or not isinstance(data, dict) or "rows" not in data:
            continue
        lines.append(f"## {part}")
        lines.append("")
        extra = {k: v for k, v in data.items() if k not in ("rows", "rounds")}
        if extra:
            lines += [", ".join(f"{k}: {v}" for k, v in extra.items()), ""]
        cols = list(data["rows"][0])
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in data["rows"]:
            lines.append("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
        lines.append("")
        if data.get("rounds"):
            lines += ["Rounds (each dtype in turn, ratios within a round):", ""]
            lines += ["| round | kv_dtype | output_tok_s | num_preemptions | vs_float32 |", "|---|---|---|---|---|"]
            for i, rows in enumerate(data["rounds"], 1):
                for r in rows:
                    lines.append(
                        f"| {i} | {r['kv_dtype']} | {r['output_tok_s']} | {r['num_preemptions']} | {r['vs_float32']} |"
                    )
            lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """results.png: blocks per GiB (the 1.7B shape), decode attention ms, perplexity change, per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "capacity" in results:
        rows = [r for r in results["capacity"]["rows"] if r["model"] == "smollm2-1.7b shape"]
        panels.append(("KV blocks per GiB (1.7B shape)", {r["kv_dtype"]: r["blocks_per_gib"] for r in rows}))
    if "attention" in results:
        rows = results["attention"]["rows"]
        panels.append(("decode attention, 16 x 8k context (ms)", {r["kv_dtype"]: r["ms"] for r in rows}))
    # every perplexity run's rows, each against the float32 cache of its own run
    ppl = [r for part, d in results.items() if part.startswith("perplexity") for r in d["rows"]]
    for model in sorted({r["model"] for r in ppl}):
        rows = [r for r in ppl if r["model"] == model and "no kernels" not in r["kv_dtype"]]
        panels.append((f"perplexity vs float32 cache (%)\n{model}", {r["kv_dtype"]: r["vs_float32_pct"] for r in rows}))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, values) in zip(axes if len(panels) > 1 else [axes], panels, strict=True):
        names = [n.replace("float8_", "") for n in values]
        ax.bar(names, list(values.values()), color="#4c72b0")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"kv_cache_dtype, {results.get('machine', {}).get('cpu', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="+", choices=("capacity", "attention", "attention-wide", "perplexity", "throughput"))
    p.add_argument("--gguf", help="the 1.7B-shape Q4_K_M file (throughput)")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="throughput: rounds of every dtype in turn, medians")
    p.add_argument(
        "--kv-dtypes", default=",".join(KV_DTYPES), help="perplexity, throughput: which caches, float32 first"
    )
    args = p.parse_args()
    path = os.path.join(HERE, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    results["machine"] = machine()
    shown = " ".join(a if "/" not in a or a.startswith("benchmarks") else "FILE" for a in sys.argv[1:])
    results["command"] = f"flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_cache_dtype/measure.py {shown}"
    kv_dtypes = args.kv_dtypes.split(",")
    subset = "" if kv_dtypes == list(KV_DTYPES) else f" ({'+'.join(kv_dtypes)})"
    for part in args.parts:
        t = time.perf_counter()
        if part == "throughput":
            key, data = part + subset, throughput(args.gguf, args.kv_gib, args.num_prompts, kv_dtypes, args.rounds)
        elif part == "perplexity":
            key, data = part + subset, perplexity(kv_dtypes)
        elif part == "attention-wide":
            key, data = part, attention(16, 8, 256)
        else:
            key, data = part, {"capacity": capacity, "attention": attention}[part]()
        data["seconds"] = round(time.perf_counter() - t, 1)
        results[key] = data
        print(json.dumps({key: data}), flush=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    with open(os.path.join(HERE, "results.md"), "w") as fh:
        fh.write(markdown(results))
    plot(results, os.path.join(HERE, "results.png"))


if __name__ == "__main__":
    main()
