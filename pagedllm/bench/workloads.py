"""Benchmark workloads: lists of requests ``{"prompt_token_ids": [...], "max_tokens": n}``.

Shared by every ``pagedllm bench`` kind; the API below is stable:

* ``load_workload(name_or_path, num_prompts, seed=0, vocab_size=49152, *, input_len=None,
  output_len=None) -> list[dict]``
* ``add_workload_args(parser)`` adds --workload, --num-prompts, --seed, --input-len, --output-len;
  ``workload_from_args(args, vocab_size)`` loads what they say.
* ``workload_summary(requests) -> dict`` (counts and length statistics, for result JSON).

Generation is meant to run to exactly ``max_tokens`` (``ignore_eos=True``), so a workload fixes
the work done, whatever the model says.

Workloads (all deterministic for a given seed; ids uniform in [3, vocab_size): 0..2 are special
tokens in the anchors' tokenizer):

``sharegpt``  the anchors' ``make_workload.py``, reproduced exactly (same RNG calls in the same order):
              prompt ~ round(LogNormal(ln 150, 0.9)) clipped [16, 1024], output ~
              round(LogNormal(ln 150, 0.8)) clipped [16, 512]. 200 requests: 36,737 prompt +
              40,072 output tokens. Request i does not depend on num_prompts (a prefix of a
              longer run).
``alpaca``    short instructions, like the vLLM paper's Alpaca trace (mean input 19.3, output 58.5
              tokens): prompt ~ round(LogNormal(ln 16, 0.6)) clipped [4, 256] (mean ~19.2), output ~
              round(LogNormal(ln 42.5, 0.8)) clipped [4, 512] (mean ~58.3).
``fixed``     every prompt ``input_len`` random ids, every output ``output_len`` tokens.
a path        a JSON file: the anchors' ``{"meta": ..., "requests": [...]}`` or a bare list. Entries
              have ``prompt_token_ids`` or a text ``prompt`` (returned as is under "prompt":
              tokenizing is the caller's job, e.g. ``LLMEngine.add_request`` accepts the dict), and
              ``max_tokens``.

``input_len`` / ``output_len`` override the lengths of a synthetic workload (``sharegpt`` /
``alpaca`` keep their random draws for the other one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
from dataclasses import dataclass

SYNTHETIC = ("sharegpt", "alpaca", "fixed")
DEFAULT_NUM_PROMPTS = 200
MIN_ID = 3  # ids 0..2 are special tokens (<|endoftext|>, <|im_start|>, <|im_end|>)


@dataclass(frozen=True)
class LengthDist:
    """round(LogNormal(ln median, sigma)) clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int


# name -> (prompt lengths, output lengths)
DISTRIBUTIONS: dict[str, tuple[LengthDist, LengthDist]] = {
    "sharegpt": (LengthDist(150, 0.9, 16, 1024), LengthDist(150, 0.8, 16, 512)),
    "alpaca": (LengthDist(16, 0.6, 4, 256), LengthDist(42.5, 0.8, 4, 512)),
}


def _lognormal_int(rng: random.Random, d: LengthDist) -> int:
    x = rng.lognormvariate(math.log(d.median), d.sigma)
    return max(d.lo, min(d.hi, int(round(x))))


def _synthetic(
    name: str, n: int, seed: int, vocab_size: int, input_len: int | None, output_len: int | None
) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    if name == "fixed":
        if input_len is None or output_len is None:
            raise ValueError("workload 'fixed' needs input_len and output_len (--input-len, --output-len).")
        for _ in range(n):
            reqs.append(
                {
                    "prompt_token_ids": [rng.randrange(MIN_ID, vocab_size) for _ in range(input_len)],
                    "max_tokens": output_len,
                }
            )
        return reqs
    pdist, odist = DISTRIBUTIONS[name]
    for _ in range(n):
        # Same draw order as make_workload.py (prompt length, output length, ids): keep it.
        plen = _lognormal_int(rng, pdist)
        olen = _lognormal_int(rng, odist)
        ids = [rng.randrange(MIN_ID, vocab_size) for _ in range(plen)]
        if input_len is not None:
            ids = ids[:input_len] + [rng.randrange(MIN_ID, vocab_size) for _ in range(input_len - len(ids))]
        reqs.append({"prompt_token_ids": ids, "max_tokens": olen if output_len is None else output_len})
    return reqs


def _from_file(path: str, num_prompts: int | None) -> list[dict]:
    with open(path) as fh:
        data = json.load(fh)
    entries = data["requests"] if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of requests or {{'requests': [...]}}.")
    if num_prompts is not None:
        if num_prompts > len(entries):
            raise ValueError(f"{path} holds {len(entries)} requests, {num_prompts} asked for.")
        entries = entries[:num_prompts]
    reqs = []
    for i, e in enumerate(entries):
        if "max_tokens" not in e:
            raise ValueError(f"{path}: request {i} has no max_tokens.")
        if "prompt_token_ids" in e:
            ids = [int(t) for t in e["prompt_token_ids"]]
            reqs.append({"prompt_token_ids": ids, "max_tokens": int(e["max_tokens"])})
        elif "prompt" in e:
            reqs.append({"prompt": str(e["prompt"]), "max_tokens": int(e["max_tokens"])})
        else:
            raise ValueError(f"{path}: request {i} has neither prompt_token_ids nor prompt.")
    return reqs


def load_workload(
    name_or_path: str,
    num_prompts: int | None,
    seed: int = 0,
    vocab_size: int = 49152,
    *,
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[dict]:
    """Returns the workload's requests, in order.

    ``num_prompts`` None means 200 for a synthetic workload and the whole file for a path.
    ``vocab_size`` bounds the random ids (pass the model's: 512 for the tests' tiny models).
    """
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}.")
    if name_or_path in SYNTHETIC:
        if vocab_size <= MIN_ID:
            raise ValueError(f"vocab_size must be > {MIN_ID}, got {vocab_size}.")
        for k, v in (("input_len", input_len), ("output_len", output_len)):
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}.")
        n = DEFAULT_NUM_PROMPTS if num_prompts is None else num_prompts
        return _synthetic(name_or_path, n, seed, vocab_size, input_len, output_len)
    if os.path.isfile(name_or_path):
        return _from_file(name_or_path, num_prompts)
    raise ValueError(f"Unknown workload {name_or_path!r}: not one of {SYNTHETIC} and not a file.")


def workload_summary(requests: list[dict]) -> dict:
    """Counts and length statistics (prompt lengths only for tokenized requests)."""
    out = [r["max_tokens"] for r in requests]
    prompts = [len(r["prompt_token_ids"]) for r in requests if "prompt_token_ids" in r]

    def describe(xs: list[int]) -> dict:
        if not xs:
            return {}
        return {
            "min": min(xs),
            "median": statistics.median(xs),
            "mean": round(statistics.mean(xs), 1),
            "max": max(xs),
        }

    return {
        "num_requests": len(requests),
        "prompt_tokens_total": sum(prompts),
        "output_tokens_total": sum(out),
        "prompt_len": describe(prompts),
        "output_len": describe(out),
    }


def add_workload_args(parser: argparse.ArgumentParser, default_num_prompts: int | None = None) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default="sharegpt",
        help=f"{' | '.join(SYNTHETIC)} | path to a JSON workload (default: sharegpt)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=default_num_prompts,
        help="requests to run (default: 200 for synthetic workloads, all of a file)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    g.add_argument("--input-len", type=int, default=None, help="fixed prompt length (synthetic workloads)")
    g.add_argument("--output-len", type=int, default=None, help="fixed output length (synthetic workloads)")


def workload_from_args(args: argparse.Namespace, vocab_size: int = 49152) -> list[dict]:
    """Loads the workload that add_workload_args' flags describe."""
    return load_workload(
        args.workload,
        args.num_prompts,
        args.seed,
        vocab_size,
        input_len=args.input_len,
        output_len=args.output_len,
    )
