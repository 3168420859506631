"""pagedllm's perplexity on llama.cpp's own tokens of the text, to separate the engine from the tokenizer.

llama.cpp's "smollm" pre-tokenizer regex lacks GPT-2's final ``\\s+`` alternative, so it merges runs
of newlines that the model's Hugging Face tokenizer splits ("\\n\\n" -> 1116 vs 198 198): 12,989
tokens instead of 13,005 for kjv-romans.txt, and every chunk after the first difference is a
slightly different window. This asks a llama-server for its tokenization (/tokenize, add_special)
and scores exactly those tokens through the engine, per quantization.

    python3 benchmarks/results/perplexity/same_tokens.py LLAMA_SERVER_BINARY TEXT [--context 512]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
import urllib.request

from pagedllm import LLM
from pagedllm.bench.perplexity import perplexity, read_text, tokenize
from pagedllm.models.resolve import default_model_gguf_path


def llamacpp_tokens(server: str, gguf: str, text: str, port: int = 18089) -> list[int]:
    srv = subprocess.Popen(
        [server, "-m", gguf, "--port", str(port), "-t", "1", "-c", "512"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.5)
        body = json.dumps({"content": text, "add_special": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/tokenize", data=body, headers={"content-type": "application/json"}
        )
        return json.loads(urllib.request.urlopen(req, timeout=120).read())["tokens"]
    finally:
        srv.terminate()
        srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("text")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    gguf = default_model_gguf_path()
    text = read_text(args.text)
    theirs = llamacpp_tokens(args.server, gguf, text)
    for q in ("none", "gguf"):
        llm = LLM(model="smollm2-135m-instruct", quantization=q, kv_cache_memory_gib=1.0)
        ours, bos = tokenize(llm.get_tokenizer(), text)
        t = time.perf_counter()
        res = perplexity(llm, theirs, args.context, bos)
        print(
            f"quantization {q}: llama.cpp tokens {len(theirs)} (pagedllm's {len(ours)}): "
            f"PPL = {res.ppl:.4f} +/- {res.ppl_stderr:.5f} ({res.chunks} chunks, {time.perf_counter() - t:.1f} s)"
        )
        print(",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(res.running_ppl)))
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
