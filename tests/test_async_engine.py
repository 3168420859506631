"""AsyncLLMEngine in-process: streaming, concurrency, aborts, step failures, idle behaviour."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError
from pagedllm.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLMEngine.from_config(config(tiny_llama))
    eng.start()
    yield eng
    eng.shutdown()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


async def run_one(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list:
    stream = await engine.add_request(
        rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, **GREEDY)
    )
    return [out async for out in stream]


def assert_free(engine: AsyncLLMEngine) -> None:
    async def stats() -> dict:
        for _ in range(100):
            s = await engine.get_stats()
            if s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0:
                return s
            await asyncio.sleep(0.01)
        return s

    s = asyncio.run(stats())
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_stream_is_cumulative_and_concurrency_does_not_change_greedy_output(engine):
    ps = prompts(12)

    async def sequential() -> list[list[int]]:
        return [(await run_one(engine, f"seq-{i}", p, 10))[-1].outputs[0].token_ids for i, p in enumerate(ps)]

    async def concurrent() -> list[list]:
        return await asyncio.gather(*(run_one(engine, f"con-{i}", p, 10) for i, p in enumerate(ps)))

    expected = asyncio.run(sequential())
    streams = asyncio.run(concurrent())
    for outs, exp in zip(streams, expected, strict=True):
        # cumulative outputs: each extends the previous (a slow reader may skip some), the last is final
        toks = [o.outputs[0].token_ids for o in outs]
        assert toks[-1] == exp and all(exp[: len(t)] == t for t in toks)
        assert [len(t) for t in toks] == sorted({len(t) for t in toks})
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # text only grows
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == "length"
    assert_free(engine)


def test_slow_reader_gets_latest_output_only(engine):
    async def go() -> list:
        stream = await engine.add_request(
            "slow", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=12, **GREEDY)
        )
        while True:  # let it finish unread
            s = await engine.get_stats()
            if not s["num_requests_running"] and not s["num_requests_waiting"]:
                break
            await asyncio.sleep(0.01)
        return [out async for out in stream]

    outs = asyncio.run(go())
    # pending outputs are replaced, not queued: one (final) output, memory bounded for slow clients
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 12


def test_bad_request_raises_and_queues_nothing(engine):
    async def go() -> None:
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("too-long", {"prompt_token_ids": [5] * 600}, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="already in use"):
            s = await engine.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=30, **GREEDY))
            await engine.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3))
        s.abort()

    asyncio.run(go())
    assert_free(engine)


def test_abort_frees_blocks_at_once(engine):
    async def go() -> int:
        stream = await engine.add_request(
            "long", {"prompt_token_ids": list(range(3, 100))}, SamplingParams(max_tokens=400, **GREEDY)
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                stream.abort()
        before = (await engine.get_stats())["generation_tokens"]
        await asyncio.sleep(0.1)
        after = (await engine.get_stats())["generation_tokens"]
        assert after == before  # nothing runs any more
        return got

    assert asyncio.run(go()) == 3  # iteration ends right after abort()
    assert_free(engine)


def test_step_exception_fails_only_the_request_that_raises(engine, monkeypatch):
    # The full containment tests are in test_fault_containment.py; this one pins the stream side.
    real_execute = engine.engine.runner.execute

    def execute(sched):
        if any(s.token_ids[:3] == [7, 8, 9] for s in sched.new_seqs):
            raise RuntimeError("injected failure")
        return real_execute(sched)

    monkeypatch.setattr(engine.engine.runner, "execute", execute)

    async def go() -> None:
        a = await engine.add_request("fail-a", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=20, **GREEDY))
        b = await engine.add_request("fail-b", {"prompt_token_ids": [9, 8]}, SamplingParams(max_tokens=20, **GREEDY))
        with pytest.raises(RequestFailedError, match="see the server log") as e:
            async for _ in a:
                pass
        assert "injected" not in str(e.value)
        outs = [o async for o in b]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 20
        outs = await run_one(engine, "after-failure", [9, 8, 7], 5)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5

    asyncio.run(go())
    assert engine.num_step_errors >= 2 and engine.is_running and engine.consecutive_step_failures == 0
    assert_free(engine)


def test_thread_safe_with_several_event_loops(engine):
    ps = prompts(6, seed=3)

    async def batch(tag: str) -> list:
        return await asyncio.gather(*(run_one(engine, f"{tag}-{i}", p, 6) for i, p in enumerate(ps)))

    expected = asyncio.run(batch("ref"))
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        results[k] = asyncio.run(batch(f"t{k}"))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(3):
        assert [r[-1].outputs[0].token_ids for r in results[k]] == [r[-1].outputs[0].token_ids for r in expected]
    assert_free(engine)


def test_idle_engine_sleeps(engine):
    assert_free(engine)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    # A busy-polling thread would burn ~0.5 s of CPU here.
    assert time.process_time() - cpu0 < 0.1 * (time.monotonic() - wall0)
    assert engine.is_running


def test_stats_snapshot_is_published_not_queried(engine, monkeypatch):
    """/metrics reads get_stats_snapshot: no call of it runs anything on the engine thread, which
    publishes at most once a second while it steps, and the last step's stats as it goes idle."""
    assert_free(engine)
    calls = []
    real = engine.engine.get_stats
    monkeypatch.setattr(engine.engine, "get_stats", lambda: calls.append(1) or real())
    before = asyncio.run(engine.get_stats_snapshot())
    t0 = time.monotonic()
    asyncio.run(run_one(engine, "snap", [3, 4, 5], 60))
    elapsed = time.monotonic() - t0
    published = len(calls)
    assert 1 <= published <= 2 + elapsed  # 60 steps, one forced publication at the end

    async def scrape() -> list[dict]:
        return [await engine.get_stats_snapshot() for _ in range(300)]

    snaps = asyncio.run(scrape())
    assert len(calls) == published
    # current, although the 300 reads came right after the request's last output
    assert snaps[-1]["generation_tokens"] == before["generation_tokens"] + 60
    assert snaps[-1]["num_requests_running"] == 0 and snaps[-1]["num_free_kv_blocks"] == snaps[-1]["num_kv_blocks"]


def test_shutdown_fails_pending_streams(tiny_llama):
    eng = AsyncLLMEngine.from_config(config(tiny_llama))
    eng.start()

    async def go() -> None:
        stream = await eng.add_request("x", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=400, **GREEDY))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("y", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):  # /metrics answers 503 as /stats does
            await eng.get_stats_snapshot()

    asyncio.run(go())
    assert not eng.is_running
