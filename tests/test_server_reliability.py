"""The server under concurrent streaming load with clients that hang up, checked against offline greedy.

Bounded: a fixed number of requests with short outputs, and an overall timeout.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from test_server import ServerProcess

from pagedllm import LLM, SamplingParams

NUM_REQUESTS = 200
CONCURRENCY = 32
NUM_PROMPTS = 40
DISCONNECT_EVERY = 10  # 10% of the requests hang up mid-stream
NON_STREAMING_EVERY = 10  # another 10% use non-streaming requests
CHAT_EVERY = 7
MODEL = "tiny"
KV_BLOCKS = 64
CHATS = [
    [{"role": "user", "content": "Explain paged attention."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block table?"}],
    [{"role": "user", "content": "def hello(world):"}],
]


@pytest.fixture(scope="module")
def server_starting(tiny_llama, tmp_path_factory):
    """The server process, still loading: the offline references are computed meanwhile."""
    # 64 blocks x 16 = 1024 KV slots for 32 concurrent requests of up to 128 tokens: the scheduler
    # has to preempt, and outputs must still equal the offline ones.
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("reliability") / "server.log"),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        str(KV_BLOCKS),
        wait=False,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(server_starting, workload):
    server_starting.wait_healthy()
    return server_starting


@pytest.fixture(scope="module")
def workload(tiny_llama, server_starting):
    """Prompts (token ids), their output lengths, chat prompts, and offline greedy references."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 64))] for _ in range(NUM_PROMPTS)]
    max_tokens = [16 + 16 * (i % 4) for i in range(NUM_PROMPTS)]
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=512)
    tok = llm.get_tokenizer()
    chat_ids = [
        tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for c in CHATS
    ]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    params += [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)] * len(CHATS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + chat_ids], params, use_tqdm=False)
    refs = [o.outputs[0].text for o in outs]
    del llm
    return prompts, max_tokens, refs[:NUM_PROMPTS], refs[NUM_PROMPTS:]


def test_concurrent_streaming_with_disconnects(server, workload):
    prompts, max_tokens, refs, chat_refs = workload
    rng = random.Random(1)
    jobs = []
    for i in range(NUM_REQUESTS):
        kind = (
            "disconnect"
            if i % DISCONNECT_EVERY == 3
            else "non_stream"
            if i % NON_STREAMING_EVERY == 5
            else "chat"
            if i % CHAT_EVERY == 0
            else "stream"
        )
        jobs.append((i, kind, rng.randrange(NUM_PROMPTS) if kind != "chat" else rng.randrange(len(CHATS))))
    rng.shuffle(jobs)
    failures: list[str] = []
    done = {"stream": 0, "non_stream": 0, "chat": 0, "disconnect": 0}

    async def one(client: openai.AsyncOpenAI, i: int, kind: str, p: int) -> None:
        if kind == "chat":
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=CHATS[p],
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage = "", None
            async for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                usage = c.usage or usage
            if text != chat_refs[p] or usage is None or usage.completion_tokens != 16:
                failures.append(f"chat {i}: {text!r} != {chat_refs[p]!r} (usage {usage})")
            done[kind] += 1
            return
        kw = dict(
            model=MODEL,
            prompt=prompts[p],
            max_tokens=max_tokens[p],
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if kind == "non_stream":
            out = await client.completions.create(**kw)
            text, usage, finish = out.choices[0].text, out.usage, out.choices[0].finish_reason
        else:
            stream = await client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            text, usage, finish, n = "", None, None, 0
            async for c in stream:
                n += 1
                if kind == "disconnect" and n == 2:
                    await stream.close()  # hang up mid-stream: the server must abort the request
                    done[kind] += 1
                    return
                if c.choices:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
                usage = c.usage or usage
        ok = (
            text == refs[p]
            and finish == "length"
            and usage is not None
            and usage.completion_tokens == max_tokens[p]
            and usage.prompt_tokens == len(prompts[p])
        )
        if not ok:
            failures.append(f"{kind} {i} (prompt {p}): {text!r} != {refs[p]!r}, finish {finish}, usage {usage}")
        done[kind] += 1

    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        async with openai.AsyncOpenAI(
            base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60
        ) as client:

            async def worker() -> None:
                while not queue.empty():
                    i, kind, p = queue.get_nowait()
                    try:
                        await one(client, i, kind, p)
                    except Exception as e:  # record, keep going: one failure must not hide the rest
                        failures.append(f"{kind} {i}: {type(e).__name__}: {e}")

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(main(), timeout=120))
    elapsed = time.monotonic() - t0
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"
    assert sum(done.values()) == NUM_REQUESTS and done["disconnect"] == NUM_REQUESTS // DISCONNECT_EVERY, done
    assert httpx.get(server.url("/health")).status_code == 200
    s = server.wait_idle(timeout=10)
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0, s
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] == KV_BLOCKS, s
    assert s["num_step_errors"] == 0
    print(f"{NUM_REQUESTS} requests in {elapsed:.1f}s, {s['num_preemptions']} preemptions")


def _generated(server: ServerProcess) -> int:
    return server.stats()["generation_tokens"]


def test_streaming_disconnect_frees_blocks_at_once(server):
    before = _generated(server)
    body = {
        "model": MODEL,
        "prompt": list(range(3, 40)),
        "max_tokens": 450,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url("/v1/completions"), json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    # the connection is closed: the request must stop long before its 450 tokens
    s = server.wait_idle(timeout=5)
    assert s["num_requests_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"], s
    assert s["generation_tokens"] - before < 400


def test_non_streaming_disconnect_frees_blocks_at_once(server):
    before = _generated(server)
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        # The client hangs up early: the tiny model makes hundreds of tokens a second, so hanging
        # up late would leave the bound below little room for the server to see it and abort.
        httpx.post(server.url("/v1/completions"), json=body, timeout=httpx.Timeout(30, read=0.1))
    s = server.wait_idle(timeout=5)
    assert s["num_requests_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"], s
    assert s["generation_tokens"] - before < 400
    assert httpx.get(server.url("/health")).status_code == 200
