"""`pagedllm bench perplexity`: the perplexity of a text, computed as llama.cpp's `llama-perplexity`
computes it by default, so that the two numbers compare (tools/perplexity/perplexity.cpp,
``perplexity()``):

- the whole text is tokenized once, with the special tokens the model adds (BOS where its
  tokenizer adds one; llama.cpp: ``common_tokenize(ctx, text, add_special=true,
  parse_special=false)``, so special-token text in the file is plain text), after dropping one
  trailing newline as llama.cpp's ``-f`` does;
- it is cut into ``n_tokens // n_ctx`` non-overlapping chunks of ``n_ctx`` tokens (the tail is
  dropped; fewer than ``2 * n_ctx`` tokens is an error); each chunk is evaluated from an empty
  context, its first token replaced by BOS when the model adds BOS;
- only the second half of each chunk is scored: with ``first = n_ctx // 2``, the logits at
  positions ``first .. n_ctx - 2`` predict tokens ``first + 1 .. n_ctx - 1`` (``n_ctx - first - 1``
  tokens per chunk), so every scored token has at least ``first`` tokens of context;
- ppl = exp(mean NLL over all scored tokens); the +/- is llama.cpp's standard error of it.

The scores come from the engine itself: every chunk is a request with
``SamplingParams(prompt_logprobs=0, max_tokens=1)``, run by the same scheduler, model runner and
attention path as any other request (continuous batching, chunked prefill).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass

from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, help="UTF-8 text file to score (llama-perplexity's -f)")
    p.add_argument("--context", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument("--output-json", default=None, help="write the result to this JSON file")
    add_engine_args(p, skip=("seed",))


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float  # llama.cpp's "+/-": standard error of the mean NLL, times ppl
    nll_mean: float
    context: int
    chunks: int
    tokens: int  # tokens in the whole text
    tokens_scored: int
    add_bos: bool
    # after each chunk, exp(mean NLL so far): llama-perplexity's "[1]x,[2]y,..." progress line
    running_ppl: list[float]


def read_text(path: str) -> str:
    """The file as llama.cpp's ``-f`` reads it: bytes as they are, less one trailing newline."""
    with open(path, encoding="utf-8", newline="") as fh:
        text = fh.read()
    return text[:-1] if text.endswith("\n") else text


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """(token ids, BOS id if the model adds BOS else None), as llama.cpp tokenizes the text."""
    bos = getattr(tokenizer, "bos_token_id", None)
    empty = tokenizer("", add_special_tokens=True)["input_ids"]
    add_bos = bos is not None and empty[:1] == [bos]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and empty[-1:] == [eos] and eos != bos:
        # llama-perplexity asserts the same (an EOS after every text would be scored as text)
        raise ValueError("This model's tokenizer adds EOS to every text: perplexity is not defined for it here.")
    ids = tokenizer(text, add_special_tokens=True, split_special_tokens=True, verbose=False)["input_ids"]
    return list(ids), bos if add_bos else None


def chunk_windows(tokens: list[int], context: int, bos_token_id: int | None, max_chunks: int | None = None):
    """The chunks llama.cpp evaluates: ``len(tokens) // context`` windows of ``context`` tokens,
    the first token of each replaced by ``bos_token_id`` unless it is None."""
    if context < 3:
        raise ValueError(f"context must be >= 3 (half of it is scored), got {context}.")
    if len(tokens) < 2 * context:
        raise ValueError(
            f"The text tokenizes to {len(tokens)} tokens; perplexity with a context of {context} needs at least "
            f"{2 * context} (llama-perplexity's rule)."
        )
    n = len(tokens) // context
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {max_chunks}.")
        n = min(n, max_chunks)
    windows = []
    for i in range(n):
        w = tokens[i * context : (i + 1) * context]
        if bos_token_id is not None:
            w[0] = bos_token_id
        windows.append(w)
    return windows


def scored_positions(context: int) -> range:
    """Indices of the tokens of a chunk whose NLL counts: first + 1 .. context - 1."""
    return range(context // 2 + 1, context)


def perplexity(
    llm, tokens: list[int], context: int, bos_token_id: int | None, max_chunks: int | None = None
) -> PerplexityResult:
    """llama-perplexity's default-mode perplexity of ``tokens`` on ``llm`` (an ``LLM``)."""
    from pagedllm import SamplingParams

    windows = chunk_windows(tokens, context, bos_token_id, max_chunks)
    max_len = llm.llm_engine.max_model_len
    if context >= max_len:
        raise ValueError(
            f"context must be < max_model_len ({max_len}): each chunk runs as a prompt that samples one token."
        )
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll = nll2 = 0.0
    count = 0
    running = []
    for w, out in zip(windows, outs, strict=True):
        lps = out.prompt_logprobs
        for j in scored_positions(context):
            v = -lps[j][w[j]].logprob
            nll += v
            nll2 += v * v
            count += 1
        running.append(math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(
        ppl=ppl,
        ppl_stderr=stderr,
        nll_mean=mean,
        context=context,
        chunks=len(windows),
        tokens=len(tokens),
        tokens_scored=count,
        add_bos=bos_token_id is not None,
        running_ppl=running,
    )


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.engine.builder import native_gguf_path

    text = read_text(args.text)
    kwargs = engine_kwargs(args, skip=("model", "seed"))
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **kwargs)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    tokens, bos = tokenize(llm.get_tokenizer(), text)
    t1 = time.perf_counter()
    res = perplexity(llm, tokens, args.context, bos, args.chunks)
    seconds = time.perf_counter() - t1
    with open(args.text, "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    result = {
        "bench": "perplexity",
        "model": args.model,
        # what the weights ran as: "gguf" (kept in their quantized blocks) or "none" (float)
        "quantization": "gguf" if native_gguf_path(engine.config) else "none",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "text": args.text,
        "text_sha256": sha,
        **asdict(res),
        "seconds": round(seconds, 3),
        "load_seconds": round(load_s, 3),
        "scored_tok_s": round(res.tokens_scored / seconds, 2),
        "engine": kwargs,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    print(",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(res.running_ppl)))
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_stderr:.5f}")
    print(f"perplexity: {res.ppl:.4f} ({res.chunks} chunks of {res.context} tokens)")
    if args.output_json:
        d = os.path.dirname(args.output_json)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=2, sort_keys=True)
            fh.write("\n")
    return 0
