"""The benchmark lock both parallel benchmarks take around their timed part, so no other timed
run (benchmark or test run under `flock /tmp/pagedllm-bench.lock`) overlaps them."""

from __future__ import annotations

import fcntl
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LOCK = "/tmp/pagedllm-bench.lock"


@contextmanager
def bench_lock() -> Iterator[None]:
    """Holds LOCK for the block; says so on stderr when it has to wait for another holder."""
    with open(LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK} (another benchmark or test run holds it)", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
