"""GrammarCache: compiled grammars and compile errors, least recently used evicted, bounded in bytes.

Bounded by what its entries hold, not by how many there are: one guided_choice of 20,000 strings
holds ~30 MiB compiled, so a count bound of a few hundred entries could hold gigabytes. Errors are
kept too, so the same bad constraint sent again is refused without compiling it again. Keys are
digests of the constraint, so a large schema is not held a second time as its key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pagedllm.structured_output.grammar import CompiledGrammar, GrammarError

Entry = CompiledGrammar | GrammarError

_ERROR_OVERHEAD_BYTES = 512  # an exception object and its traceback-free state


def entry_bytes(entry: Entry) -> int:
    if isinstance(entry, CompiledGrammar):
        return entry.nbytes
    return _ERROR_OVERHEAD_BYTES + len(str(entry))


class GrammarCache:
    """Thread-safe; ``max_bytes`` 0 keeps nothing (every request compiles its own)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, entry: Entry) -> None:
        """Keeps ``entry`` and evicts the least recently used until the total fits; an entry larger
        than the whole bound is not kept (the request that compiled it still runs with it)."""
        size = entry_bytes(entry)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= entry_bytes(old)
            if size > self.max_bytes:
                return
            self._entries[key] = entry
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= entry_bytes(evicted)
