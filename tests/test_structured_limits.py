"""What an output constraint may cost the engine, in process: each distinct constraint compiled
once (failures too), in the compile threads with a time limit; the compiled-grammar cache bounded
in bytes, with an honest size estimate; masks computed ahead, so a slow one holds back only its
own sequence; a constraint that fails ends its sequence (never runs on unconstrained) and logs
one line without the request's content.

The server's side of the same bounds (caps, 400s, latencies) is test_server_constraints.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import random
import string
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.resolve import default_model_gguf_path, resolve_model_path
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.grammar import BYTES_PER_GRAMMAR_BYTE, GrammarError
from pagedllm.structured_output.limits import CompileSettings
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.state import STOP_REASON
from pagedllm.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def words(n: int, seed: int, k: int = 10) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(k)) for _ in range(n)]


def manager(model_dir: str, **settings) -> StructuredOutputManager:
    tok = load_tokenizer(model_dir)
    kw = {"cache_bytes": 256 * 2**20, "timeout_s": 30.0, "workers": 1, **settings}
    return StructuredOutputManager(tok, len(tok), tok.eos_token_id, CompileSettings(**kw))


def test_compiled_once_failures_cached_and_shared_in_flight(tiny_llama):
    m = manager(tiny_llama)
    choice = StructuredOutputsParams(choice=words(50, 0))
    assert m.compile(choice) is m.compile(StructuredOutputsParams(choice=words(50, 0)))
    assert m.compiler.num_compiles == 1  # compiling is the check: no validation pass besides
    bad = StructuredOutputsParams(grammar="root ::= undefined_rule")
    for _ in range(3):
        with pytest.raises(GrammarError, match="does not parse"):
            m.compile(bad)
    assert m.compiler.num_compiles == 2  # the failure was cached

    async def together() -> list:
        schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
        return await asyncio.gather(*(m.compile_async(schema) for _ in range(8)))

    compiled = asyncio.run(together())
    assert all(c is compiled[0] for c in compiled) and m.compiler.num_compiles == 3  # one compile for all 8
    assert any(t.name.startswith("pagedllm-grammar") for t in threading.enumerate())


def test_cache_is_bounded_in_bytes(tiny_llama):
    bound = 4 * 2**20
    m = manager(tiny_llama, cache_bytes=bound)
    lists = [words(400, seed) for seed in range(12)]
    sizes = [m.compile(StructuredOutputsParams(choice=c)).nbytes for c in lists]
    assert sum(sizes) > 2 * bound  # more than it may keep...
    assert m.compiler.cache.nbytes <= bound and len(m.compiler.cache) < len(lists)  # ...so it kept less
    n = m.compiler.num_compiles
    m.compile(StructuredOutputsParams(choice=lists[-1]))  # the latest stayed
    assert m.compiler.num_compiles == n
    m.compile(StructuredOutputsParams(choice=lists[0]))  # the oldest was evicted: compiled again
    assert m.compiler.num_compiles == n + 1
    assert m.compiler.cache.nbytes <= bound


def rss_bytes() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: RSS is what is held
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(default_model_gguf_path() is None, reason="the default model is not installed")
def test_size_estimate_covers_what_a_compiled_grammar_holds():
    """The cache's bound is only as good as its estimate: measured with the default model's 49k
    vocabulary, for the three shapes whose size matters (many choices, many tools, many properties)."""
    m = manager(resolve_model_path("smollm2-135m-instruct", weights=False), cache_bytes=2**40)
    assert m.tokenizer is not None  # built once, before measuring

    def tools(i: int) -> dict:  # a tool_choice "required" list: one of 300 tools, 3 parameters each
        names = words(1200, 100 + i, k=8)
        alternatives = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": names[4 * j]},
                    "parameters": {
                        "type": "object",
                        "properties": {n: {"type": "string"} for n in names[4 * j + 1 : 4 * j + 4]},
                    },
                },
            }
            for j in range(300)
        ]
        return {"type": "array", "items": {"anyOf": alternatives}}

    shapes = {
        "choice": lambda i: StructuredOutputsParams(choice=words(4000, i)),
        "tools": lambda i: StructuredOutputsParams(json=tools(i)),
        "properties": lambda i: StructuredOutputsParams(
            json={"type": "object", "properties": {w: {"type": "integer"} for w in words(800, 200 + i)}}
        ),
    }
    for name, make in shapes.items():
        before = rss_bytes()
        compiled = [m.compile(make(i)) for i in range(4)]
        held = (rss_bytes() - before) / len(compiled)
        estimate = sum(c.nbytes for c in compiled) / len(compiled)
        # Never less than it holds (the bound holds), nor wildly more (the cache is not needlessly small).
        assert held <= estimate <= 4 * held + 2**20, (name, held, estimate, BYTES_PER_GRAMMAR_BYTE)


def test_compile_time_limit_refuses_the_request_and_caches_the_result(tiny_llama):
    m = manager(tiny_llama, timeout_s=0.05)
    big = StructuredOutputsParams(choice=words(20000, 1))
    start = time.monotonic()
    with pytest.raises(GrammarError, match="took more than 0.05 s"):
        asyncio.run(m.compile_async(big))
    assert time.monotonic() - start < 5  # the request was answered at its limit...
    deadline = time.monotonic() + 60
    while len(m.compiler.cache) == 0 and time.monotonic() < deadline:  # ...the compile went on, to the cache
        time.sleep(0.05)
    asyncio.run(m.compile_async(big))
    assert m.compiler.num_compiles == 1


def test_a_slow_mask_holds_back_only_its_own_sequence(tiny_llama, monkeypatch):
    """Masks of a constrained sequence take 50 ms each (as a heavy grammar's may): the step does
    not wait for them. An unconstrained request beside it finishes its 40 tokens while the
    constrained one has made only a few, and then in about the time it takes alone."""
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, seed=0)
    engine = llm.llm_engine
    normal = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(["alone"], normal, use_tqdm=False)
    alone = time.perf_counter() - start

    real = StructuredOutputManager._compute_mask

    def slow(self, matcher):
        time.sleep(0.05)
        return real(self, matcher)

    monkeypatch.setattr(StructuredOutputManager, "_compute_mask", slow)
    regex = StructuredOutputsParams(regex="[a-z ]{1,200}")
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True, structured_outputs=regex)
    engine.add_request("constrained", "x", constrained)
    engine.add_request("normal", "y", normal)
    start = time.perf_counter()
    done: dict[str, object] = {}
    while "normal" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    beside = time.perf_counter() - start
    assert "constrained" not in done
    assert beside < 2 * alone + 0.05, (beside, alone)  # not 40 x 50 ms
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    text = done["constrained"].outputs[0].text
    assert 1 <= len(text) <= 200 and set(text) <= set(string.ascii_lowercase + " "), text


def test_a_failed_constraint_ends_the_sequence_and_logs_one_line(tiny_llama, caplog):
    """An object of 1,000 optional properties: after '{"' llguidance's parser holds more items in
    a row than its limit (2,000), and the matcher fails. The sequences end at once (no token after
    it, no unconstrained text), with stop_reason STOP_REASON, and one warning for the request that
    quotes nothing of it."""
    names = words(1000, 5, k=8)
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, seed=0)
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=50, structured_outputs={"json": schema})
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        (out,) = llm.generate(['{"'], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.stop_reason == STOP_REASON, c
        assert len(c.token_ids) < 10 and c.text in ("", "{", '{"'), c.text
    lines = [r.getMessage() for r in caplog.records if "structured output failed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert not any(n in r.getMessage() for r in caplog.records for n in names)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_manager.num_free_blocks() == engine.num_kv_blocks
