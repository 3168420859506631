"""`pagedllm bench throughput`: its result fields, including the memory roofline's byte counts."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.throughput import decode_kv_read_bytes


def test_decode_kv_reads_count_every_decode_steps_context():
    # prompt 3, 4 new tokens: token 1 comes from the prefill, tokens 2-4 from decode steps that
    # attend over 4, 5 and 6 tokens; prompt 10, 1 new token: no decode step at all.
    reqs = [{"prompt_token_ids": [1, 2, 3], "max_tokens": 4}, {"prompt_token_ids": [5] * 10, "max_tokens": 1}]
    assert decode_kv_read_bytes(reqs, kv_bytes_per_token=100) == (4 + 5 + 6) * 100


def test_bench_throughput_reports_both_rooflines(tiny_llama, tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    reqs = [
        {"prompt_token_ids": [3 + (5 * i + j) % 200 for j in range(4 + 3 * i)], "max_tokens": 3 + i} for i in range(4)
    ]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"meta": {}, "requests": reqs}))
    argv = ["bench", "throughput", "--model", tiny_llama, "--workload", str(workload), "--repeats", "2", "--no-save"]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert r["workload"]["num_requests"] == 4 and r["output_tok_s"] > 0
    # All four prompts fit one prefill step; then one decode step per further token of the longest.
    assert r["engine_steps"] == max(q["max_tokens"] for q in reqs)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # fp32 checkpoint
    assert r["decode_kv_read_bytes"] == decode_kv_read_bytes(reqs, per_token)
    # every step reads every weight once (fp32, unpacked: the parameters are the weights)
    assert r["weight_read_bytes"] == r["engine_steps"] * r["model_params"] * 4
    assert r["read_bandwidth_gbs"] > 0
    bytes_read = r["decode_kv_read_bytes"] + r["weight_read_bytes"]
    assert r["memory_roofline_s"] == pytest.approx(bytes_read / (r["read_bandwidth_gbs"] * 1e9), abs=0.01)
    assert 0 <= r["memory_roofline_fraction"] <= 1
