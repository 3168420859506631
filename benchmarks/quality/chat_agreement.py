"""Greedy chat answers of a GGUF file run natively vs its float-weights run, and llama.cpp's
answers on the same file vs the same float answers: how often does integer execution change an
answer?

    python3 benchmarks/quality/chat_agreement.py [--model smollm2-135m-instruct] [--gguf FILE]
        [--llamacpp-bin DIR] [--max-tokens 32] [--out-dir benchmarks/results/quality_agreement]

Each prompt of benchmarks/data/chat-prompts-50.txt becomes one user turn through the model's chat
template (pagedllm's tokenizer, generation prompt added); every engine gets exactly those token
ids, so templates and tokenizers cannot differ:
- float: pagedllm with ``quantization="none"`` (the file dequantized at load, float32 activations;
  HF-exact, tests/test_fidelity), the reference;
- native: pagedllm with the blocks kept (int8 / int16 activations, the engine's default);
- llama.cpp: llama-server on the same file (``/completion`` with the prompt's token ids,
  temperature 0, no prompt cache), when ``--llamacpp-bin`` is given.
An answer agrees when its token ids up to EOS or ``--max-tokens`` equal the float answer's.
Run under the benchmark lock (flock): it is CPU-bound for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "data", "chat-prompts-50.txt")


def chat_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def pagedllm_answers(model: str, prompt_ids: list[list[int]], max_tokens: int, **engine) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, num_threads=2, kv_cache_memory_gib=0.5, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_answers(bin_dir: str, gguf: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    port = free_port()
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "-t", "2", "-c", "4096", "-np", "1"]
    server = subprocess.Popen(
        [*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        answers = []
        for ids in prompt_ids:
            body = {
                "prompt": ids,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
            }
            req = urllib.request.Request(
                base + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                toks = json.load(r)["tokens"]
            answers.append(toks)  # EOS (which pagedllm keeps, llama.cpp not) is stripped by main
        return answers
    finally:
        server.terminate()
        server.wait(timeout=30)


def strip_eos(ans: list[int], eos: set[int]) -> list[int]:
    return [t for t in ans if t not in eos]


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    prefix = []
    for a, b in zip(ref, other, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {"identical": same, "of": len(ref), "mean_tokens_before_divergence": sum(prefix) / len(prefix)}


def main() -> int:
    from pagedllm.models.resolve import default_model_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--gguf", default=None, help="the GGUF file llama.cpp runs (default: the default model's)")
    p.add_argument("--llamacpp-bin", default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out-dir", default="benchmarks/results/quality_agreement")
    args = p.parse_args()
    with open(PROMPTS) as fh:
        prompts = [line.strip() for line in fh if line.strip()]

    from pagedllm import LLM

    probe = LLM(model=args.model, num_threads=2, kv_cache_memory_gib=0.1, quantization="none")
    tok = probe.get_tokenizer()
    eos = set(probe.llm_engine.eos_token_ids)
    del probe
    prompt_ids = chat_token_ids(tok, prompts)
    answers = {
        "float": pagedllm_answers(args.model, prompt_ids, args.max_tokens, quantization="none"),
        "native": pagedllm_answers(args.model, prompt_ids, args.max_tokens),
    }
    if args.llamacpp_bin:
        gguf = args.gguf or default_model_gguf_path()
        answers["llama.cpp"] = llamacpp_answers(args.llamacpp_bin, gguf, prompt_ids, args.max_tokens)
    ref = [strip_eos(a, eos) for a in answers["float"]]
    result = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "agreement_with_float": {
            k: agreement(ref, [strip_eos(a, eos) for a in v]) for k, v in answers.items() if k != "float"
        },
        "answers": {k: [tok.decode(a) for a in v] for k, v in answers.items()},
        "prompts_text": prompts,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["agreement_with_float"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
