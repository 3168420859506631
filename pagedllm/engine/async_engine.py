"""AsyncLLMEngine: runs LLMEngine.step() in one background thread and streams outputs to asyncio.

Why a thread: a model forward takes milliseconds to seconds and would freeze the event loop
(no new connections, no health checks, no disconnect detection) if it ran there. torch releases
the GIL inside its kernels, so the loop stays responsive while the engine computes.

Thread safety: the LLMEngine is touched by the engine thread only. Other threads talk to it
through a command queue (add / abort / queries such as stats) that the engine thread drains between steps, so no
lock is held across a forward pass and an abort frees its KV blocks before the very next step.
Outputs go back to each request's own RequestStream (request_stream.py) through
``loop.call_soon_threadsafe`` (one call per step and event loop, not one per token).

When no request is unfinished the thread sleeps on a threading.Event that every command sets:
no busy polling. Between steps, and once a minute while idle, it hands the heap's free pages back
to the OS (host_memory.PeriodicHeapRelease): RSS follows live memory, not its peak.

Stats for /metrics are pushed, not queried: the engine thread publishes a snapshot of get_stats()
at most once per ``STATS_INTERVAL_S`` while it steps, and after every step that leaves it idle
(before that step's outputs are delivered, so a client that got its response scrapes the counters
that include it). A scrape reads the latest snapshot and never waits on, or wakes, the engine
thread: a flood of scrapes cannot slow the steps.

Fault containment: a step that raises is retried on subsets of the requests it scheduled
(bisection, ``LLMEngine.step(only_requests=...)``; the others keep their blocks and wait) until
one request is found that fails alone. That request alone is failed (its stream raises
``RequestFailedError`` with a generic message; the exception is only logged) and aborted, so its
blocks are freed; the others go on as if nothing happened. A failure no subset reproduces
(transient) fails nobody, unless steps keep failing: after ``max_step_failures`` failed steps in
a row, the requests of the failing step are failed. ``consecutive_step_failures`` (what /health
reports) counts failed steps since the last one that succeeded.

A crash of the thread itself (a bug in this loop, a BaseException from a step) fails every stream
with EngineDeadError and calls ``on_dead`` (the server exits on it rather than hang).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.client import ModelFacts
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.host_memory import PeriodicHeapRelease, release_idle_memory
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.async_engine")

# Called in the engine thread for every output of every step: (output, time of this request's
# previous token or None if this is its first). Used for latency histograms; must be cheap.
OutputHook = Callable[[RequestOutput, float | None], None]
# How stale the /metrics snapshot may get while the engine steps (Prometheus scrapes every 15 s or so).
STATS_INTERVAL_S = 1.0


class AsyncLLMEngine:
    """An LLMEngine driven by a background thread, with asyncio streams per request (an EngineClient)."""

    def __init__(self, engine: LLMEngine, output_hook: OutputHook | None = None) -> None:
        self.engine = engine
        self.facts = ModelFacts.of(engine)
        self.tokenizer = engine.tokenizer
        self.output_hook = output_hook
        self._commands: collections.deque[tuple] = collections.deque()  # append/popleft are atomic
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._last_token_time: dict[str, float] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats: dict = {}  # the latest snapshot of engine.get_stats() (a new dict each time)
        self._stats_time = float("-inf")  # time.monotonic() of that snapshot
        self.num_step_errors = 0  # steps that raised, retries included
        self.consecutive_step_failures = 0  # failed (non-retry) steps since the last good step
        self.max_step_failures = 3
        self.heap_release = PeriodicHeapRelease(release=release_idle_memory)
        # Called (from the engine thread) when the thread dies of an exception, not on shutdown().
        self.on_dead: Callable[[BaseException], None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, output_hook: OutputHook | None = None) -> AsyncLLMEngine:
        return cls(LLMEngine(config), output_hook)

    # ---- life cycle ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread after its current step (every unfinished stream raises
        EngineDeadError), then the engine's tensor-parallel workers (LLMEngine.shutdown)."""
        self._stop = True
        self._wake.set()
        still_stepping = False
        if self._thread is not None:
            self._thread.join(timeout)
            still_stepping = self._thread.is_alive()
        self.engine.shutdown(graceful=not still_stepping)

    # ---- API for the event loop (any thread) --------------------------------------------
    def _submit(self, cmd: tuple) -> None:
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        self._commands.append(cmd)
        self._wake.set()

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it.

        Raises what LLMEngine.add_request raises (ValueError for a bad request, nothing queued).
        """
        grammar = None
        if params is not None and params.structured_outputs is not None:
            # Compiled before it is queued, in the compile threads (never this loop or the engine
            # thread); a GrammarError (a ValueError) refuses the request.
            grammar = await self.engine.structured.compile_async(params.structured_outputs)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self)
        fut: asyncio.Future[None] = loop.create_future()
        self._submit(("add", stream, prompt, params, arrival_time, grammar, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it undoes it
            raise
        return stream

    def abort(self, request_ids: str | list[str]) -> None:
        """Aborts requests (non-blocking, thread-safe); unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids and self.is_running:
            self._commands.append(("abort", ids))
            self._wake.set()

    async def get_stats(self) -> dict:
        """LLMEngine.get_stats(), computed by the engine thread between steps (a consistent snapshot),
        with this thread's step-failure counters."""
        return self._with_step_counters(await self._query(self.engine.get_stats))

    async def get_stats_snapshot(self) -> dict:
        """get_stats() as the engine thread last published it (see the module docstring): at most
        STATS_INTERVAL_S old while requests run, current while the engine is idle. No query."""
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        return self._with_step_counters(self._stats)

    def _with_step_counters(self, stats: dict) -> dict:
        failures = self.consecutive_step_failures
        return {**stats, "num_step_errors": self.num_step_errors, "consecutive_step_failures": failures}

    async def get_kv_blocks(self, replica: int | None = None) -> dict:
        """LLMEngine.get_kv_blocks(), taken by the engine thread between steps (a consistent snapshot).

        ``replica``: only None or 0 (one engine; the EngineClient signature of data parallelism)."""
        if replica not in (None, 0):
            raise ValueError(f"replica={replica}: this server runs one engine (replica 0).")
        return await self._query(self.engine.get_kv_blocks)

    async def health_problem(self) -> str | None:
        """None while the thread runs and its steps succeed; else what /health reports."""
        if not self.is_running:
            return "The engine is not running."
        if self.consecutive_step_failures >= self.max_step_failures:
            return f"The engine's last {self.consecutive_step_failures} steps failed."
        return None

    async def _query(self, read: Callable[[], dict]) -> dict:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict] = loop.create_future()
        self._submit(("query", fut, read))
        return await fut

    # ---- the engine thread --------------------------------------------------------------
    @staticmethod
    def _resolve(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def set_it() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        try:
            fut.get_loop().call_soon_threadsafe(set_it)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        """Hands (stream, output or exception) pairs to their event loops, one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass

    def _drain_commands(self) -> bool:
        """Runs the queued commands; True if one added or aborted a request (the stats changed)."""
        changed = False
        while self._commands:
            cmd = self._commands.popleft()
            kind = cmd[0]
            if kind == "add":
                _, stream, prompt, params, arrival_time, grammar, fut = cmd
                try:
                    self.engine.add_request(stream.request_id, prompt, params, arrival_time, compiled_grammar=grammar)
                except Exception as e:  # ValueError / NotImplementedError: the caller's fault
                    self._resolve(fut, error=e)
                    continue
                self._streams[stream.request_id] = stream
                self._resolve(fut)
                changed = True
            elif kind == "abort":
                ids = [i for i in cmd[1] if i in self._streams]
                if ids:
                    changed = True
                    try:
                        self.engine.abort_request(ids)
                    except Exception:  # an engine bug: log it, keep the thread alive
                        logger.exception("aborting %s failed", ids)
                    for i in ids:
                        self._streams.pop(i, None)
                        self._last_token_time.pop(i, None)
            elif kind == "query":
                try:
                    self._resolve(cmd[1], cmd[2]())
                except Exception as e:
                    self._resolve(cmd[1], error=e)
        return changed

    def _step(self) -> bool:
        """One engine step, outputs delivered; False if the step raised (see _contain)."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_step_errors += 1
            self.consecutive_step_failures += 1
            self._contain(e)
            self._publish_stats(force=not self.engine.has_unfinished_requests())
            return False
        self.consecutive_step_failures = 0
        self._publish_stats(force=not self.engine.has_unfinished_requests())
        self._deliver_outputs(outputs)
        return True

    def _publish_stats(self, force: bool) -> None:
        """A new get_stats() snapshot for /metrics when forced (the engine is going idle) or the
        last one is STATS_INTERVAL_S old. A failure is logged: metrics must never break serving."""
        now = time.monotonic()
        if not force and now - self._stats_time < STATS_INTERVAL_S:
            return
        try:
            self._stats = self.engine.get_stats()
        except Exception:
            logger.exception("engine stats failed")
        self._stats_time = now

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.output_hook is not None:
                t = out.metrics.get("last_token_time")
                try:
                    self.output_hook(out, self._last_token_time.get(out.request_id))
                except Exception:  # metrics must never break serving
                    logger.exception("output hook failed")
                if t is not None:
                    self._last_token_time[out.request_id] = t
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._last_token_time.pop(out.request_id, None)
            items.append((stream, out))
        if items:
            self._deliver(items)

    def _contain(self, error: Exception) -> None:
        """A step raised: find the request that makes it raise by retrying subsets, and fail only it.

        Each retry runs the first half of the suspects (the requests of the failed step). If it
        succeeds, those advanced a normal step and are cleared; if it raises, the suspects shrink
        to what it ran. One suspect that raises alone is the culprit. Every retry either clears a
        request or halves the suspects, so this ends within about 2 x log2(n) + n steps.
        """
        suspects = self.engine.last_step_request_ids()
        logger.error(
            "engine step failed with %d request(s) scheduled; isolating the cause", len(suspects), exc_info=error
        )
        failing = list(suspects)  # what the last failed step ran
        for _ in range(2 * len(suspects) + 4):
            if not suspects:
                break
            part = suspects[: max(1, len(suspects) // 2)]
            try:
                outputs = self.engine.step(only_requests=part)
            except Exception as e:
                self.num_step_errors += 1
                ran = [r for r in self.engine.last_step_request_ids() if r in part]
                if not ran:
                    break
                if len(ran) == 1:
                    logger.error("request %s fails the step on its own; failing it", ran[0], exc_info=e)
                    self._fail(ran)
                    return
                suspects = failing = ran
                continue
            self.consecutive_step_failures = 0  # the engine can step: the fault is not everywhere
            self._deliver_outputs(outputs)
            ran = set(self.engine.last_step_request_ids())
            if not ran:
                break  # nothing of the subset could run (preempted): no information
            suspects = [r for r in suspects if r not in ran]
        logger.warning("no single request reproduces the step failure")
        if self.consecutive_step_failures >= self.max_step_failures:
            logger.error(
                "%d failed steps in a row: failing the requests of the last one", self.consecutive_step_failures
            )
            self._fail(failing or list(self._streams))  # nothing scheduled: the fault is before the runner

    def _fail(self, ids: list[str]) -> None:
        """Fails and aborts these requests (their blocks are freed); the error's text stays in the log."""
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the failed requests raised too")
        failure = RequestFailedError("The engine failed while running this request; see the server log.")
        self._deliver([(self._streams[i], failure) for i in ids if i in self._streams])
        for i in ids:
            self._streams.pop(i, None)
            self._last_token_time.pop(i, None)

    def _run(self) -> None:
        try:
            self._publish_stats(force=True)
            while not self._stop:
                self._wake.clear()  # before draining: a command queued after this wakes the wait below
                changed = self._drain_commands()
                if self._stop:
                    break
                self.heap_release.maybe_release()  # at most once a minute
                if not self.engine.has_unfinished_requests():
                    if changed:  # an add or abort the engine took without a step since
                        self._publish_stats(force=True)
                    self._wake.wait(self.heap_release.interval_s)  # wakes to trim what the last steps freed
                    continue
                if not self._step():
                    # Pause briefly (commands still wake us): should the engine keep requests we
                    # could not abort, failing steps must not spin the CPU.
                    self._wake.wait(0.05)
        except BaseException as e:  # a bug in the loop itself: make it visible, fail everyone
            logger.exception("engine thread crashed")
            self._deliver([(s, EngineDeadError("The engine thread crashed.")) for s in self._streams.values()])
            self._streams.clear()
            if self.on_dead is not None:
                try:
                    self.on_dead(e)
                except Exception:
                    logger.exception("on_dead hook failed")
            raise
        finally:
            self._stop = True
            dead = EngineDeadError("The engine was shut down.")
            self._deliver([(s, dead) for s in self._streams.values()])
            self._streams.clear()
            # Commands that arrived too late: answer their futures so no caller hangs.
            while self._commands:
                cmd = self._commands.popleft()
                if cmd[0] in ("add", "query"):
                    self._resolve(cmd[-1] if cmd[0] == "add" else cmd[1], error=dead)


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._put(item)
