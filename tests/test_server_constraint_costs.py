"""What expensive output constraints cost `pagedllm serve` and everyone else on it: the default
model (its 49k-token vocabulary is what makes grammars costly), a real server on loopback with
the constraint caps raised so that costly constraints get through, a 48 MB grammar cache and a
1 s compile limit.

- A compile over its time limit is a 400 at the limit, and compiles queued behind each other in
  their own low-priority threads leave a concurrent request within 2x of its latency alone.
- Distinct large constraints one after another hold at most the cache's megabytes.
- Sequences whose masks are expensive do not stall a concurrent request.
- A recursive tool schema pushed by logit_bias into nesting deeper than Python's JSON parser
  reads comes back as content (the old parser's RecursionError was a 500); streamed, as a call
  whose arguments were sent as written, cut at the length limit.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import openai
import pytest
from test_server import ServerProcess
from test_structured_limits import words

from pagedllm.models.resolve import default_model_gguf_path, resolve_model_path
from pagedllm.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(default_model_gguf_path() is None, reason="the default model is not installed")

MODEL = "smol"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
CACHE_MB = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        "smollm2-135m-instruct",
        str(tmp_path_factory.mktemp("server") / "server.log"),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "512",
        "--max-constraint-choices",
        "100000",
        "--max-constraint-bytes",
        str(4 * 2**20),
        env={"PAGEDLLM_GRAMMAR_CACHE_MB": str(CACHE_MB), "PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=300)


def normal_latency(client, k: int = 3) -> float:
    """Median seconds of a plain 24-token chat completion."""
    times = []
    for _ in range(k):
        start = time.perf_counter()
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def post(server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=timeout)


def in_background(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_compiles_over_their_limit_are_400s_and_cost_others_little(server, client):
    alone = normal_latency(client)
    answers: list[tuple[httpx.Response, float]] = []

    def slow_compile(seed: int) -> None:  # 60,000 choices: 2-5 s of compile each, one at a time
        start = time.perf_counter()
        body = {"prompt": "Pick:", "max_tokens": 8, "guided_choice": words(60000, seed)}
        r = post(server, "/v1/completions", body)
        answers.append((r, time.perf_counter() - start))

    threads = [in_background(slow_compile, seed) for seed in range(3)]
    time.sleep(0.5)
    beside = normal_latency(client)
    for t in threads:
        t.join()
    for r, seconds in answers:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "guided_choice" and "took more than 1 s to compile" in error["message"]
        assert seconds < 10, seconds  # refused at the limit, not after the compile
    assert beside <= 2 * alone, (beside, alone)


def compiled_once(server, body: dict) -> None:
    """Sends ``body`` until it is answered 200: a compile longer than the limit, or queued behind
    one, finishes without the request that started it and is cached."""
    deadline = time.monotonic() + 120
    while (r := post(server, "/v1/completions", body)).status_code != 200:
        assert "to compile" in r.text and time.monotonic() < deadline, r.text


def server_rss(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_distinct_large_constraints_hold_at_most_the_cache_size(server):
    """40 distinct 4,000-string choices (~4 MB compiled each; a cache bounded by count kept all,
    ~150 MB): the server grows by at most the cache's 48 MB and some slack."""

    def pick(seed: int) -> None:
        r = post(server, "/v1/completions", {"prompt": "Pick:", "max_tokens": 8, "guided_choice": words(4000, seed)})
        assert r.status_code == 200, r.text

    compiled_once(server, {"prompt": "Pick:", "max_tokens": 8, "guided_choice": words(4000, 1000)})
    for seed in range(1001, 1003):  # warm: first compiles, allocator arenas
        pick(seed)
    before = server_rss(server)
    for seed in range(40):
        pick(seed)
    grown = server_rss(server) - before
    assert grown <= (CACHE_MB + 32) * 2**20, grown / 2**20


def test_expensive_masks_do_not_stall_a_concurrent_request(server, client):
    """A 12,000-string choice, whose masks take up to ~40 ms each (the old engine computed them in
    the step every request waits for), requested over and over by two clients (compiled once:
    ~35 MB estimated, it stays in the cache)."""
    body = {"prompt": "Pick:", "max_tokens": 6, "temperature": 1.0, "guided_choice": words(12000, 5)}
    compiled_once(server, body)
    alone = normal_latency(client)
    stop = threading.Event()

    statuses: list[int] = []

    def load() -> None:
        while not stop.is_set():
            statuses.append(post(server, "/v1/completions", body).status_code)

    threads = [in_background(load) for _ in range(2)]
    try:
        time.sleep(0.5)
        beside = normal_latency(client)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(statuses) >= 10 and set(statuses) == {200}, statuses
    assert beside <= 2 * alone, (beside, alone)


@pytest.mark.parametrize("stream", [False, True])
def test_nesting_deeper_than_json_parses_comes_back_as_content(server, client, stream):
    nest = {
        "$id": "urn:nest",
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/n"}},
        "required": ["x"],
        "additionalProperties": False,
        "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
    }
    vocab = load_tokenizer(resolve_model_path("smollm2-135m-instruct", weights=False)).get_vocab()
    bias = {str(vocab[t]): 100 for t in ("[", "[[")}  # the grammar allows them: the model nests on
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Nest."}],
        tools=[{"type": "function", "function": {"name": "nest", "parameters": nest}}],
        tool_choice="required",
        max_tokens=560,
        logit_bias=bias,
        seed=0,  # sampled (greedy nests too shallow), the same draws every run
    )
    if stream:
        # Streamed, the call's name and arguments go out as they are written (as vLLM's and
        # OpenAI's servers stream them) and cannot be taken back when the output is cut; the
        # finished text then does not parse, and follows as content, as it is answered unstreamed.
        content, finish, names, arguments = "", None, [], ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                for call in c.delta.tool_calls or []:
                    names += [call.function.name] if call.function.name else []
                    arguments += call.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "length" and names == ["nest"]
        assert arguments.startswith('{"x": [[') and arguments in content, arguments[:80]  # sent until too deep
        assert content.startswith('[{"name": "nest", "parameters": {"x": ') and "[" * 1000 in content, content[:80]
        return
    r = client.chat.completions.create(**kw)
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert not r.choices[0].message.tool_calls and finish == "length"
    assert content.startswith('[{"name": "nest", "parameters": {"x": ') and "[" * 1000 in content, content[:80]
