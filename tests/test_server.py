"""End-to-end tests of `pagedllm serve` through the real `openai` client.

One server subprocess per module (loading torch + the model takes seconds); every test talks to
it over loopback. ``ServerProcess`` is reused by the other server test modules.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

API_KEY = "sk-test-key"
SECOND_KEY, THIRD_KEY = "sk-second", "sk-third"  # several keys: comma-separated and a repeated flag
MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagedllm.entrypoints.cli serve MODEL ...` on a free loopback port, up until stop()."""

    def __init__(
        self,
        model_dir: str,
        log_path: str,
        *extra_args: str,
        env: dict | None = None,
        wait: bool = True,
        module: str = "pagedllm.entrypoints.cli",
    ) -> None:
        self.port = free_port()
        # The first --api-key (of possibly several, comma-separated): /stats needs it.
        keys = [extra_args[i + 1] for i, a in enumerate(extra_args) if a == "--api-key"]
        self.api_key = keys[0].split(",")[0] if keys else None
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            module,
            "serve",
            model_dir,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "256",
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
            *extra_args,
        ]
        self._log = open(log_path, "wb")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        """Waits for /health (start-up loads torch and the model); stops the process on failure."""
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def url(self, path: str) -> str:
        return self.base_url + path

    def stats(self) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.get(self.url("/stats"), timeout=10, headers=headers)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Polls /stats until no request is running or waiting; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextmanager
def served(model_dir: str, tmp_path_factory, *extra_args: str, **kwargs) -> Iterator[ServerProcess]:
    """A ServerProcess logging into a fresh temporary folder, stopped on leaving (module fixtures)."""
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("server") / "server.log"), *extra_args, **kwargs)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--api-key",
        f"{API_KEY},{SECOND_KEY}",
        "--api-key",
        THIRD_KEY,
        "--served-model-name",
        MODEL_NAME,
        "extra-alias",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


PROMPT = "The quick brown fox jumps over"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a block table."},
]


def test_health_version_models(server, client):
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version"), headers={"Authorization": f"Bearer {API_KEY}"}).json()["version"]
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL_NAME, "extra-alias"]
    # the alias serves too, and is echoed back
    out = client.completions.create(model="extra-alias", prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.model == "extra-alias"


def test_auth(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url("/v1/completions"), json=body, headers=headers)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "API key" in err["message"]
    assert httpx.get(server.url("/v1/models")).status_code == 401
    bad = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    for key in (API_KEY, SECOND_KEY, THIRD_KEY):
        r = httpx.post(server.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, key
    # every route but /health and /metrics needs the key
    for path in ("/stats", "/docs", "/openapi.json", "/version", "/no-such-route"):
        r = httpx.get(server.url(path))
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(server.url(path), headers={"Authorization": f"Bearer {SECOND_KEY}"})
        assert ok.status_code == (404 if path == "/no-such-route" else 200), (path, ok.status_code)
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/metrics")).status_code == 200


def test_completion_usage_and_streaming(client, tokenizer):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_token_id_prompts_and_batches(client):
    ids = [5, 17, 300, 42, 8]
    single = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert single.usage.prompt_tokens == len(ids) and single.usage.completion_tokens == 6
    batch = client.completions.create(
        model=MODEL_NAME,
        prompt=[[1, 2, 3], ids],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 3 + len(ids) and batch.usage.completion_tokens == 12
    strings = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "def hello"], max_tokens=4, temperature=0)
    assert len(strings.choices) == 2
    # streaming a batch: each index reassembles to its non-streamed text
    parts = {0: "", 1: ""}
    for c in client.completions.create(
        model=MODEL_NAME,
        prompt=[[1, 2, 3], ids],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for ch in c.choices:
            parts[ch.index] += ch.text
    assert parts == {0: batch.choices[0].text, 1: batch.choices[1].text}


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and val <= 0
        # greedy: the chosen token is the most likely one
        assert val == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == lp.tokens


def test_echo_logprobs_and_prompt_logprobs(client, tokenizer):
    """echo + logprobs leads the logprobs with the prompt's (the first null, as OpenAI); vLLM's
    prompt_logprobs gives the same values per prompt token; streaming gives the same."""
    n_prompt = len(tokenizer.encode(PROMPT))
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    kw["extra_body"] = {"ignore_eos": True, "prompt_logprobs": 1}
    out = client.completions.create(**kw, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    plp = choice.model_extra["prompt_logprobs"]
    ids = tokenizer.encode(PROMPT)
    assert len(plp) == n_prompt and plp[0] is None
    for j in range(1, n_prompt):
        entry = plp[j][str(ids[j])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[j], abs=1e-6)
        assert entry["decoded_token"] == lp.tokens[j]
        assert 1 <= len(plp[j]) <= 2  # the prompt token + top 1
    # without echo: the completion's logprobs only
    plain = client.completions.create(**kw).choices[0]
    assert plain.logprobs.tokens == lp.tokens[n_prompt:]
    assert plain.model_extra["prompt_logprobs"] == plp
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert streamed == lp.tokens
    assert [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices][0] == plp


def test_stream_events_are_one_line_for_any_line_reader(server):
    """U+0085, U+2028 and U+2029 are line ends to str.splitlines() and so to httpx's iter_lines
    (which SSE clients read with): the server escapes them in its events' JSON."""
    prompt = "a\u2028b\x85c\u2029d"
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, echo=True, stream=True, temperature=0)
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith(prompt)


def test_echo_stop_seed(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)
    base = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = next(
        (
            base[i : i + 2]
            for i in range(3, len(base) - 2)
            if base[i : i + 2].strip() and base.find(base[i : i + 2]) == i
        ),
        None,
    )
    assert stop is not None, base
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == base[: base.find(stop)]
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text
    kw = dict(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    a = client.completions.create(**kw, presence_penalty=0.5, frequency_penalty=0.5)
    b = client.completions.create(**kw, presence_penalty=0.5, frequency_penalty=0.5)
    assert a.choices[0].text == b.choices[0].text


def test_n_greater_than_one(client):
    # Engines without parallel sampling answer a clear 400; with it, n choices numbered per prompt.
    kw = dict(model=MODEL_NAME, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    try:
        out = client.completions.create(prompt=[[1, 2, 3, 4], [5, 6, 7]], n=3, **kw)
    except openai.BadRequestError as e:
        assert "n > 1" in e.message
        return
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 6
    assert out.usage.prompt_tokens == 4 + 3  # once per prompt, not per choice
    streamed: dict[int, str] = {}
    for c in client.completions.create(prompt=[[1, 2, 3, 4], [5, 6, 7]], n=3, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {c.index: c.text for c in out.choices}  # seeded: the same samples
    chat = client.chat.completions.create(messages=MESSAGES, n=2, **kw)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12
    # best_of > n: the best one comes back as choice 0; it cannot be streamed
    best = client.completions.create(prompt=PROMPT, n=1, best_of=3, **kw)
    assert [c.index for c in best.choices] == [0]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(prompt=PROMPT, n=1, best_of=3, stream=True, **kw)


def test_chat(client, tokenizer):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw, max_tokens=16)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant"
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert full.usage.completion_tokens == 16 and full.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(**kw, max_tokens=16, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # max_completion_tokens (the newer name) wins over max_tokens
    short = client.chat.completions.create(**kw, max_tokens=16, max_completion_tokens=4)
    assert short.usage.completion_tokens == 4 and msg.content.startswith(short.choices[0].message.content)
    # content as a list of text parts is the same prompt
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    same = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert same.choices[0].message.content == msg.content


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    r = httpx.get(server.url("/metrics"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "kv_cache_waste_perc",
        "kv_blocks_shared",
        "num_free_kv_blocks",
    ]:
        assert f"\npagedllm:{name}{{" in text, name
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagedllm:") and "_bucket" not in line
    }
    assert samples["pagedllm:generation_tokens_total"] >= 4
    assert samples["pagedllm:time_to_first_token_seconds_count"] >= 1
    assert samples["pagedllm:e2e_request_latency_seconds_count"] >= 1
    assert samples["pagedllm:num_free_kv_blocks"] == 256
    # capacity in tokens and bytes: 256 blocks of 16 tokens, K and V per layer of the tiny model
    assert samples["pagedllm:kv_cache_capacity_tokens"] == 256 * 16
    assert samples["pagedllm:kv_cache_capacity_bytes"] == server.stats()["kv_cache_bytes"] > 0


def test_bench_serve_cli(server, tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    reqs = [{"prompt_token_ids": [3 + (7 * i + j) % 500 for j in range(5 + i)], "max_tokens": 4 + i} for i in range(6)]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"meta": {}, "requests": reqs}))
    result = tmp_path / "result.json"
    argv = [
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--model",
        MODEL_NAME,
        "--api-key",
        API_KEY,
        "--workload",
        str(workload),
        "--num-prompts",
        "6",
        "--request-rate",
        "50",
        "--max-concurrency",
        "4",
        "--result-json",
        str(result),
    ]
    assert main(argv) == 0
    r = json.loads(result.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == sum(q["max_tokens"] for q in reqs)
    assert r["total_input_tokens"] == sum(len(q["prompt_token_ids"]) for q in reqs)
    for k in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{k}_ms"] <= r[f"p99_{k}_ms"], k
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    out = capsys.readouterr().out
    assert "| Request throughput (req/s) |" in out and "| TTFT |" in out


def test_stats_clean_after_module(server):
    s = server.wait_idle()
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] == 256
    assert s["num_step_errors"] == 0
    assert "Traceback" not in server.log_tail(100_000)


def test_openapi_documents_the_error_responses(server):
    r = httpx.get(server.url("/openapi.json"), headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    doc = r.json()
    assert '"422"' not in json.dumps(doc)  # validation errors are answered 400 in OpenAI's shape
    ref = "#/components/schemas/ErrorBody"
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        for code in ("400", "401", "404", "413", "500", "503"):
            assert responses[code]["content"]["application/json"]["schema"]["$ref"] == ref, (path, code)
    assert set(doc["components"]["schemas"]["ErrorBody"]["properties"]) == {"error"}
    health = doc["paths"]["/health"]["get"]["responses"]
    assert not health["200"].get("content") and "503" in health
    assert "text/plain" in next(iter(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]))
