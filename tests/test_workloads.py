"""Benchmark workloads: the anchors' ShareGPT-like generator reproduced exactly, Alpaca-like, files."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.bench.workloads import add_workload_args, load_workload, workload_from_args, workload_summary


def test_sharegpt_matches_the_anchor_totals():
    reqs = load_workload("sharegpt", 200)
    s = workload_summary(reqs)
    # benchmarks/anchors/make_workload.py -n 200: 36,737 prompt + 40,072 output tokens
    assert (s["num_requests"], s["prompt_tokens_total"], s["output_tokens_total"]) == (200, 36737, 40072)
    assert all(16 <= len(r["prompt_token_ids"]) <= 1024 and 16 <= r["max_tokens"] <= 512 for r in reqs)
    assert all(3 <= t < 49152 for r in reqs for t in r["prompt_token_ids"])
    # a shorter run is a prefix of a longer one (requests do not depend on num_prompts)
    assert load_workload("sharegpt", 20) == reqs[:20]
    assert load_workload("sharegpt", None) == reqs


# sha256 of the canonical JSON (see _digest) of the sharegpt workload, 200 requests, seed 0, vocab
# 49152: the anchors' defaults (benchmarks/anchors/make_workload.py OUT.json -n 200 gives the same
# requests). Every committed CPU speed measurement ran on this workload: if the digest changes,
# they no longer describe what `--workload sharegpt` runs.
SHAREGPT_200_SHA256 = "1d709a0f11bb194e1d19ed56a4a0a0717011512633c91f8ecdf3c896f9007f99"
ANCHORS = Path(__file__).resolve().parents[1] / "benchmarks" / "anchors"


def _digest(requests: list[dict]) -> str:
    canon = [{"prompt_token_ids": list(r["prompt_token_ids"]), "max_tokens": int(r["max_tokens"])} for r in requests]
    return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()


def test_sharegpt_matches_the_committed_checksum():
    assert _digest(load_workload("sharegpt", 200, seed=0, vocab_size=49152)) == SHAREGPT_200_SHA256


def test_anchors_generator_matches_the_committed_checksum(tmp_path):
    out = tmp_path / "workload-200.json"
    subprocess.run(
        [sys.executable, str(ANCHORS / "make_workload.py"), str(out), "-n", "200"],
        check=True,
        capture_output=True,
    )
    assert _digest(json.loads(out.read_text())["requests"]) == SHAREGPT_200_SHA256


def test_seed_and_vocab():
    a = load_workload("sharegpt", 5, seed=1)
    assert a == load_workload("sharegpt", 5, seed=1)
    assert a != load_workload("sharegpt", 5, seed=2)
    small = load_workload("sharegpt", 20, vocab_size=512)
    assert all(3 <= t < 512 for r in small for t in r["prompt_token_ids"])


def test_alpaca_is_short():
    reqs = load_workload("alpaca", 2000)
    p = statistics.mean(len(r["prompt_token_ids"]) for r in reqs)
    o = statistics.mean(r["max_tokens"] for r in reqs)
    assert 17 < p < 22 and 53 < o < 64  # the paper's Alpaca trace: 19.3 in, 58.5 out
    assert reqs == load_workload("alpaca", 2000)


def test_fixed_lengths_and_overrides():
    reqs = load_workload("fixed", 4, input_len=7, output_len=3)
    assert [len(r["prompt_token_ids"]) for r in reqs] == [7] * 4
    assert [r["max_tokens"] for r in reqs] == [3] * 4
    with pytest.raises(ValueError):
        load_workload("fixed", 4)
    over = load_workload("sharegpt", 6, input_len=50, output_len=9)
    assert all(len(r["prompt_token_ids"]) == 50 and r["max_tokens"] == 9 for r in over)
    # the output override keeps the prompts of the plain workload
    base = load_workload("sharegpt", 6)
    assert [r["prompt_token_ids"] for r in load_workload("sharegpt", 6, output_len=9)] == [
        r["prompt_token_ids"] for r in base
    ]


def test_json_files(tmp_path):
    anchors = tmp_path / "w.json"
    reqs = load_workload("sharegpt", 5)
    anchors.write_text(json.dumps({"meta": {}, "requests": reqs}))
    assert load_workload(str(anchors), None) == reqs
    assert load_workload(str(anchors), 2) == reqs[:2]
    with pytest.raises(ValueError):
        load_workload(str(anchors), 6)
    text = tmp_path / "t.json"
    text.write_text(json.dumps([{"prompt": "Hello there", "max_tokens": 4}]))
    assert load_workload(str(text), None) == [{"prompt": "Hello there", "max_tokens": 4}]
    assert workload_summary(load_workload(str(text), None))["output_tokens_total"] == 4
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps([{"max_tokens": 4}]))
    with pytest.raises(ValueError):
        load_workload(str(bad), None)
    with pytest.raises(ValueError, match="Unknown workload"):
        load_workload("no-such-workload", 3)


def test_cli_args():
    p = argparse.ArgumentParser()
    add_workload_args(p)
    args = p.parse_args(["--workload", "alpaca", "--num-prompts", "3", "--seed", "4"])
    assert workload_from_args(args) == load_workload("alpaca", 3, seed=4)
    args = p.parse_args("--workload fixed --num-prompts 2 --input-len 5 --output-len 6".split())
    expected = load_workload("fixed", 2, 0, 100, input_len=5, output_len=6)
    assert workload_from_args(args, vocab_size=100) == expected
