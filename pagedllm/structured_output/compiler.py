"""GrammarCompiler: each distinct constraint compiled once, in a small pool of its own threads.

The server awaits ``compile_async`` before it queues a request, so compiling never runs on the
event loop or on the engine thread (which only copies the compiled matcher). Requests for a
constraint being compiled wait for that compile instead of starting another; results, errors
included, go to a byte-bounded cache (cache.py). A request waits at most ``timeout_s`` for its
compile: then it is refused (a 400) while the compile finishes in its thread and is cached, since
llguidance cannot be interrupted. The pool's size bounds how many compiles run at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf

from pagedllm.structured_output.cache import GrammarCache
from pagedllm.structured_output.grammar import CompiledGrammar, GrammarError, compile_grammar
from pagedllm.structured_output.limits import CompileSettings, lower_thread_priority, parser_limits
from pagedllm.structured_output.params import StructuredOutputsParams


def _digest(params: StructuredOutputsParams) -> bytes:
    kind, value, compact, prefix = params.key()
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{kind}\0{int(compact)}\0{prefix}\0".encode())
    h.update(value.encode("utf-8", "surrogatepass"))
    return h.digest()


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, settings: CompileSettings) -> None:
        """``tokenizer``: the engine's (a transformers fast tokenizer); ``vocab_size``: the width of
        the model's logits (may exceed the tokenizer's: padding rows are never allowed)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        self._eos = eos_token_id
        self.settings = settings
        self.cache = GrammarCache(settings.cache_bytes)
        self.num_compiles = 0  # compiles run (cache misses that were not already in flight)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._limits = parser_limits()
        self._inflight: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~1 s for a 50k vocabulary), not when an engine starts.
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                    )
                except Exception as e:  # a slow tokenizer, or one llguidance cannot read
                    raise GrammarError(f"structured outputs need a fast (Rust) tokenizer: {e}") from e
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, compiled in this thread unless cached or in flight elsewhere
        (the offline LLM's path); GrammarError if it cannot run."""
        return self._start(params, here=True).result()

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, from the pool; GrammarError if it cannot run or takes longer
        than the timeout (the compile goes on, and is cached, without this request)."""
        fut = asyncio.wrap_future(self._start(params, here=False))
        fut.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.settings.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"structured outputs: the {params.kind} constraint took more than "
                f"{self.settings.timeout_s:g} s to compile; simplify it."
            ) from None

    def _start(self, params: StructuredOutputsParams, here: bool) -> Future:
        key = _digest(params)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is not None:
                return fut
            fut = Future()
            hit = self.cache.get(key)
            if hit is not None:
                _settle(fut, hit)
                return fut
            self._inflight[key] = fut
            self.num_compiles += 1
        if here:
            self._build(key, params, fut)
        else:
            if self._pool is None:
                with self._lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(
                            self.settings.workers, "pagedllm-grammar", initializer=lower_thread_priority
                        )
            self._pool.submit(self._build, key, params, fut)
        return fut

    def _build(self, key: bytes, params: StructuredOutputsParams, fut: Future) -> None:
        try:
            result: CompiledGrammar | GrammarError = compile_grammar(params, self.tokenizer, self._limits, self.words)
        except GrammarError as e:
            result = e
        except BaseException as e:  # llguidance's panics are BaseExceptions; nothing may escape a worker
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            result = GrammarError(f"structured outputs: the {params.kind} constraint cannot be compiled.")
        self.cache.put(key, result)
        with self._lock:
            self._inflight.pop(key, None)
        _settle(fut, result)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(fut: Future, result: CompiledGrammar | GrammarError) -> None:
    if isinstance(result, GrammarError):
        # A fresh exception per waiter: a cached one raised again would grow its traceback.
        fut.set_exception(GrammarError(str(result)))
    else:
        fut.set_result(result)


def _retrieve(fut: asyncio.Future) -> None:
    """Marks a compile's outcome as seen: a request that stopped waiting (timeout, disconnect)
    must not leave asyncio's 'exception was never retrieved' in the log."""
    if not fut.cancelled():
        fut.exception()
