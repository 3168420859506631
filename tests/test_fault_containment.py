"""Issue 22: a step that raises fails only the request that makes it raise.

The runner is patched to raise whenever a prompt holding TRIGGER is in the batch: the other
requests in flight must finish with the greedy output of a clean run, no block may leak, and the
prefix cache must stay consistent.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.request_stream import RequestFailedError
from pagedllm.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
TRIGGER = 2  # a token id no innocent prompt holds


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLMEngine.from_config(
        EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=16, enable_prefix_caching=True)
    )
    eng.start()
    yield eng
    eng.shutdown()


def innocent_prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(20)]  # a shared prefix: exercises the prefix cache
    return [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def poison_runner(engine: AsyncLLMEngine, monkeypatch, secret: str = "secret internal detail") -> dict:
    runner = engine.engine.runner
    real = runner.execute
    calls = {"raised": 0}

    def execute(sched):
        if any(TRIGGER in s.token_ids[: s.num_prompt_tokens] for s in sched.new_seqs):
            calls["raised"] += 1
            raise RuntimeError(secret)
        return real(sched)

    monkeypatch.setattr(runner, "execute", execute)
    return calls


async def run(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int = 8) -> list[int] | Exception:
    stream = await engine.add_request(
        rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, **GREEDY)
    )
    try:
        last = None
        async for out in stream:
            last = out
        return last.outputs[0].token_ids
    except RequestFailedError as e:
        return e


async def idle_stats(engine: AsyncLLMEngine) -> dict:
    for _ in range(200):
        s = await engine.get_stats()
        if s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0:
            return s
        await asyncio.sleep(0.01)
    return s


def check_clean(engine: AsyncLLMEngine) -> None:
    s = asyncio.run(idle_stats(engine))
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"], s
    engine.engine.kv_manager.check_invariants()


@pytest.mark.parametrize("num_innocent,culprit_at", [(1, 0), (5, 2), (7, 7)])
def test_one_bad_request_does_not_fail_the_others(engine, monkeypatch, num_innocent, culprit_at):
    ps = innocent_prompts(num_innocent)

    async def clean() -> list:
        return await asyncio.gather(*(run(engine, f"clean-{num_innocent}-{i}", p) for i, p in enumerate(ps)))

    expected = asyncio.run(clean())
    assert all(TRIGGER not in t for t in expected)
    check_clean(engine)
    engine.engine.reset_prefix_cache()
    errors_before = engine.num_step_errors
    calls = poison_runner(engine, monkeypatch)
    bad = [5, TRIGGER, 9, 11]

    async def faulty() -> list:
        jobs = [run(engine, f"f-{num_innocent}-{i}", p) for i, p in enumerate(ps)]
        jobs.insert(culprit_at, run(engine, f"bad-{num_innocent}", bad))
        return await asyncio.gather(*jobs)

    got = asyncio.run(faulty())
    err = got.pop(culprit_at)
    assert isinstance(err, RequestFailedError), err
    assert "secret" not in str(err) and "RuntimeError" not in str(err)
    assert got == expected
    assert calls["raised"] >= 2 and engine.num_step_errors > errors_before
    assert engine.consecutive_step_failures == 0 and engine.is_running
    check_clean(engine)


def test_every_step_failing_counts_consecutive_failures_and_recovers(engine, monkeypatch):
    runner = engine.engine.runner
    real = runner.execute
    broken = {"on": True}

    def execute(sched):
        if broken["on"] and not sched.is_empty:
            raise RuntimeError("the kernel cannot do this shape")
        return real(sched)

    monkeypatch.setattr(runner, "execute", execute)

    async def go() -> None:
        for i in range(3):
            r = await run(engine, f"broken-{i}", [5, 6, 7], 4)
            assert isinstance(r, RequestFailedError)
        assert engine.consecutive_step_failures >= engine.max_step_failures
        broken["on"] = False
        r = await run(engine, "fixed", [5, 6, 7], 4)
        assert isinstance(r, list) and len(r) == 4
        assert engine.consecutive_step_failures == 0

    asyncio.run(go())
    check_clean(engine)


def test_transient_failure_fails_nobody(engine, monkeypatch):
    real_step = engine.engine.step
    trap = {"fired": 0}

    def flaky_step(only_requests=None):
        if only_requests is None and not trap["fired"] and engine.engine.get_num_unfinished_requests() >= 2:
            trap["fired"] += 1
            engine.engine.core.last_scheduled = [
                sid
                for sid in engine.engine._group_of  # as if it had scheduled everything
            ]
            raise RuntimeError("once")
        return real_step(only_requests)

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    ps = innocent_prompts(3)

    async def go() -> list:
        return await asyncio.gather(*(run(engine, f"t-{i}", p) for i, p in enumerate(ps)))

    got = asyncio.run(go())
    assert all(isinstance(g, list) and len(g) == 8 for g in got)
    assert trap["fired"] == 1
    check_clean(engine)
