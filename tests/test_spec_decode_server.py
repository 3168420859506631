"""The server with --speculative-config: the same greedy completions as the offline engine without
speculation (whole and streamed; n-gram and a draft model), the counters on /metrics under vLLM's
names, and a config it cannot honour stops it at start-up with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from test_server import ServerProcess

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[42] * 10, [100, 101, 102] * 6]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("spec_log") / "server.log")
    srv = ServerProcess(tiny_llama, log, "--metrics-prefix", "vllm", "--speculative-config", json.dumps(NGRAM))
    yield srv
    srv.stop()


BODY = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def plain_texts(model: str) -> list[str]:
    """PROMPTS' greedy texts from an engine without speculation."""
    plain = LLM(model=model, dtype="float32", num_kv_blocks=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in plain]


def served_texts(srv: ServerProcess) -> list[str]:
    """PROMPTS' greedy texts from the server, one non-streamed completions request."""
    r = httpx.post(srv.url("/v1/completions"), json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_completions_equal_the_engine_without_speculation(server, tiny_llama):
    plain = plain_texts(tiny_llama)
    assert served_texts(server) == plain
    # Streamed: several tokens may come in one step; the deltas still add up to the text.
    texts = ["", ""]
    with httpx.stream("POST", server.url("/v1/completions"), json={**BODY, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts == plain
    samples = spec_samples(server)
    drafts = [float(v) for k, v in samples.items() if k.startswith("vllm:spec_decode_num_drafts_total")]
    accepted = [float(v) for k, v in samples.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and drafts[0] > 0 and accepted and accepted[0] > 0
    assert any(k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total") for k in samples)


def spec_samples(server: ServerProcess) -> dict[str, str]:
    """The spec_decode series of /metrics, once the engine has published its stats after the
    requests (it does so at most once a second while busy)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("vllm:spec_decode"))
        drafts = [v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_drafts_total")]
        if (drafts and float(drafts[0]) > 0) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_unsupported_config_stops_the_server_at_start_up(tiny_llama):
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_llama, "--port", "0"]
    config = {"model": "draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}
    cmd += ["--speculative-config", json.dumps(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "draft_tensor_parallel_size=2 is not supported" in done.stdout + done.stderr


def test_draft_model_server(tiny_llama, tmp_path):
    """--speculative-config with a draft model (the target itself: every draft is accepted)."""
    config = {"model": tiny_llama, "num_speculative_tokens": 3}
    log = str(tmp_path / "server.log")
    srv = ServerProcess(tiny_llama, log, "--metrics-prefix", "vllm", "--speculative-config", json.dumps(config))
    try:
        assert served_texts(srv) == plain_texts(tiny_llama)
        samples = spec_samples(srv)
        value = {k.split("{")[0]: float(v) for k, v in samples.items() if "per_pos" not in k}
        assert value["vllm:spec_decode_num_drafts_total"] > 0
        assert value["vllm:spec_decode_num_accepted_tokens_total"] == value["vllm:spec_decode_num_draft_tokens_total"]
    finally:
        srv.stop()
