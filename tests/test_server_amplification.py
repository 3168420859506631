"""Small requests that cost far more than their size: each gets its 400 or a bounded cost, and a
normal request sent beside them takes at most twice its time alone, measured in the same test.

Against the default model: its 49,152-token vocabulary and 8,192-token context are what these
requests were reproduced with (the tiny test model has neither).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx
import pytest
from test_server import ServerProcess

from pagedllm.models.resolve import default_model_gguf_path

pytestmark = pytest.mark.skipif(default_model_gguf_path() is None, reason="the default model is not installed")

MODEL = "smol"
VOCAB = 49152
# 5,120 KV tokens: enough for the 4,000-token prompt and its 32 choices, so that what refuses the
# prompt_logprobs request is the response budget, not --max-request-tokens.
KV_BLOCKS = 320
SMALL = {"model": MODEL, "prompt": "Name the capital of France.", "max_tokens": 4, "temperature": 0}
SLOWDOWN = 2.0  # a normal request beside the bad ones: at most this times its latency alone
RUNS = 5  # latencies are medians of this many runs (the machine's other work adds noise)
LOAD_CLIENT = os.path.join(os.path.dirname(__file__), "load_client.py")
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        "smollm2-135m-instruct",
        str(tmp_path_factory.mktemp("amplification") / "server.log"),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        str(KV_BLOCKS),
    )
    yield srv
    srv.stop()


def _timed_small(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=SMALL)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def small_latency_alone(server: ServerProcess) -> float:
    """The median of a few runs of the normal request, the server otherwise idle."""
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        _timed_small(c)  # warm
        return statistics.median(_timed_small(c) for _ in range(RUNS))


def small_latency_beside(
    server: ServerProcess, tmp_path, bad: list[tuple[str, bytes | None]], repeat: int = 1
) -> tuple[float, list[list]]:
    """The normal request's latency while another process sends the ``bad`` (path, JSON body or
    None for a GET) requests, each ``repeat`` times, 16 at once (load_client.py): the median over
    RUNS runs of the load, with the last run's [status, error param] answers."""
    files: dict[bytes, str] = {}
    for _, body in bad:
        if body is not None and body not in files:
            files[body] = str(tmp_path / f"body{len(files)}.json")
            with open(files[body], "wb") as f:
                f.write(body)
    spec = {"requests": [[p, files.get(b)] for p, b in bad], "repeat": repeat, "concurrency": 16}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, LOAD_CLIENT, server.base_url, str(tmp_path / "spec.json")]
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        _timed_small(c)  # warm
        for _ in range(RUNS):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "go"
                time.sleep(0.05)  # the load is in flight first
                latencies.append(_timed_small(c))
                out, _ = proc.communicate(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 0
    return statistics.median(latencies), json.loads(out.strip().splitlines()[-1])


def assert_400(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def assert_not_slowed(beside: float, alone: float, what: str = "alone") -> None:
    print(f"normal request: {alone:.3f} s {what}, {beside:.3f} s beside the bad requests ({beside / alone:.2f}x)")
    assert beside <= SLOWDOWN * alone, f"{beside:.3f} s beside the bad requests vs {alone:.3f} s {what}"


def test_prompt_logprobs_over_n_choices_are_refused(server, tmp_path):
    """4,000 prompt ids, n=32, prompt_logprobs=20: 23 KB that asked for a 174 MiB response. Prompt
    logprobs now come once per prompt, and even once they are over the response budget; echo with
    logprobs repeats them in every choice (OpenAI's format) and is refused too."""
    rng = random.Random(0)
    ids = [rng.randrange(200, VOCAB) for _ in range(4000)]
    bodies = [
        {"model": MODEL, "prompt": ids, "n": 32, "prompt_logprobs": 20},
        {"model": MODEL, "prompt": ids, "n": 32, "echo": True, "logprobs": 5, "max_tokens": 0},
    ]
    encoded = [json.dumps(b, separators=(",", ":")).encode() for b in bodies]
    assert len(encoded[0]) < 24_000
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        for body, field in zip(encoded, ["prompt_logprobs", "logprobs"], strict=True):
            err = assert_400(c.post("/v1/completions", content=body, headers=JSON), field)
            assert "MiB" in err["message"] and "--max-prompt-response-bytes" in err["message"]
    alone = small_latency_alone(server)
    beside, answers = small_latency_beside(server, tmp_path, [("/v1/completions", b) for b in encoded])
    assert answers == [[400, "prompt_logprobs"], [400, "logprobs"]]
    assert_not_slowed(beside, alone)


def test_token_control_caps_and_a_vocabulary_sized_allowed_list(server, tmp_path):
    """allowed_token_ids at most the vocabulary (the finding's 1.3M ids: a 400), logit_bias at most
    300 entries, bad_words 64. Then n=16 allowing every token, with 300 biases: masks built once
    at admission, so the normal request beside it is slowed by the 16 sequences' compute (a CPU
    step of 17 rows takes about 4 times one of 1), not by the controls."""
    http = httpx.Client(base_url=server.base_url, timeout=120)
    finding = {**SMALL, "n": 16, "allowed_token_ids": (list(range(VOCAB)) * 27)[:1_300_000]}
    assert "49152" in assert_400(http.post("/v1/completions", json=finding), "allowed_token_ids")["message"]
    r = http.post("/v1/completions", json={**SMALL, "logit_bias": {str(t): 1.0 for t in range(301)}})
    assert "300" in assert_400(r, "logit_bias")["message"]
    assert_400(http.post("/v1/completions", json={**SMALL, "bad_words": ["x"] * 65}), "bad_words")
    plain = {**SMALL, "n": 16, "max_tokens": 8, "temperature": 1.0}
    controls = {"allowed_token_ids": list(range(VOCAB)), "logit_bias": {str(t): -1.0 for t in range(300)}}
    beside_plain, answers = small_latency_beside(server, tmp_path, [("/v1/completions", json.dumps(plain).encode())])
    assert answers == [[200, None]]
    body = json.dumps({**plain, **controls}).encode()
    beside, answers = small_latency_beside(server, tmp_path, [("/v1/completions", body)])
    assert answers == [[200, None]]
    assert_not_slowed(beside, beside_plain, "beside the same n=16 request without the controls")


def test_huge_prompts_are_refused_before_tokenizing(server, tmp_path):
    """Six 1.3M-character prompts (more than 16 characters a token of the context): 400s without
    tokenizing them (a second each, which queued every request behind them)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 30_000)[:1_300_000]
    completion = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    refused = [("/v1/completions", completion, "prompt"), ("/v1/chat/completions", chat, "messages")]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        for path, body, param in refused:
            err = assert_400(c.post(path, content=body, headers=JSON), param)
            assert "1300000 characters" in err["message"] and err["code"] == "context_length_exceeded"
        # 16 characters a token of the 5,120 a request may use here: 81,920; 80,000 spaces are
        # 1,250 tokens of this vocabulary, tokenized and run.
        assert c.post("/v1/completions", json={**SMALL, "prompt": " " * 80_000}).status_code == 200
    alone = small_latency_alone(server)
    bad = [("/v1/completions", completion)] * 5 + [("/v1/chat/completions", chat)]
    beside, answers = small_latency_beside(server, tmp_path, bad)
    assert answers == [[400, "prompt"]] * 5 + [[400, "messages"]]
    assert_not_slowed(beside, alone)


def test_metrics_scrapes_do_not_slow_requests(server, tmp_path):
    """300 scrapes of /metrics beside a normal request: each reads the stats the engine last
    published (never a query of the engine thread), rendered again only when they changed."""
    alone = small_latency_alone(server)
    beside, answers = small_latency_beside(server, tmp_path, [("/metrics", None)], repeat=300)
    assert answers == [[200, None]] * 300
    assert_not_slowed(beside, alone)
    # Idle again: the last published stats are current (the requests above all counted).
    text = httpx.get(server.url("/metrics")).text
    assert 'pagedllm:num_requests_running{model_name="smol"} 0.0' in text
    assert server.stats()["generation_tokens"] == _sample(text, "pagedllm:generation_tokens_total")


def _sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])
