"""The CLI's allocator set-up: re-exec under tcmalloc once when installed, never loop."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pagedllm import host_memory


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    monkeypatch.setattr(host_memory, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    monkeypatch.delenv("PAGEDLLM_NO_TCMALLOC", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    return calls


def test_reexecs_the_cli_with_tcmalloc_preloaded(execs):
    host_memory.reexec_with_tcmalloc(["serve", "m", "--port", "1"])
    ((path, args, env),) = execs
    assert path == sys.executable
    assert args == [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "m", "--port", "1"]
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/lib/other.so"
    assert env["PAGEDLLM_NO_TCMALLOC"] == "1"  # the child does not re-exec again


@pytest.mark.parametrize(
    "setup",
    [
        lambda mp: mp.setenv("PAGEDLLM_NO_TCMALLOC", "1"),
        lambda mp: mp.setenv("LD_PRELOAD", "/x/libtcmalloc.so.4"),
        lambda mp: mp.setattr(host_memory, "find_tcmalloc", lambda: None),
        lambda mp: mp.setattr(host_memory.sys, "platform", "darwin"),
    ],
)
def test_no_reexec_when_off_loaded_absent_or_not_linux(execs, monkeypatch, setup):
    setup(monkeypatch)
    host_memory.reexec_with_tcmalloc(["generate", "hi"])
    assert execs == []


def test_found_tcmalloc_really_preloads():
    lib = host_memory.find_tcmalloc()
    if lib is None:
        pytest.skip("no tcmalloc installed here (the CLI then keeps glibc's allocator)")
    probe = "print(any('tcmalloc' in line for line in open('/proc/self/maps')))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, "LD_PRELOAD": lib}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _huge_kib_in(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, overlaps = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlaps = lo < end and hi > start
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


_HUGE_PAGE_PROBE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_host_memory import _huge_kib_in
from pagedllm.runner.kv_cache import allocate_kv_cache
caches = [t for kv in allocate_kv_cache(2, 8192, 16, 4, 64, torch.bfloat16, torch.device("cpu")) for t in kv]
assert all(not t.any() for t in caches)  # still zeroed: attention relies on it
print(min(_huge_kib_in(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in caches))  # 64 MiB each
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux only")
def test_kv_cache_is_backed_by_huge_pages_where_the_kernel_allows():
    import torch

    assert not host_memory.advise_huge_pages(torch.empty(1024))  # no whole 2 MiB page inside
    assert host_memory.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))  # madvise accepts it
    # A fresh process: in this one, earlier tests' freed (already touched) memory may be reused.
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_NO_HUGE_PAGES"}
    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGE_PROBE, here], env=env, capture_output=True, text=True, check=True
    )
    huge_kib = int(out.stdout.split()[-1])
    if _thp_mode() in ("always", "madvise"):
        assert huge_kib >= 32 << 10  # most of the 64 MiB tensor


def test_cpu_kv_caches_are_separate_aligned_views_of_one_buffer():
    import torch

    from pagedllm.runner.kv_cache import allocate_kv_cache

    caches = [t for kv in allocate_kv_cache(3, 10, 4, 2, 8, torch.float32, torch.device("cpu")) for t in kv]
    assert len(caches) == 6 and all(t.shape == (10, 2, 4, 8) and t.is_contiguous() for t in caches)
    assert caches[0].data_ptr() % host_memory.HUGE_PAGE == 0  # the buffer starts on a huge page
    assert all(t.data_ptr() % 64 == 0 for t in caches)  # then packed end to end, cache-line aligned
    nbytes = caches[0].numel() * caches[0].element_size()
    assert caches[-1].data_ptr() - caches[0].data_ptr() == 5 * nbytes  # no per-view padding
    assert all(t.untyped_storage().data_ptr() == caches[0].untyped_storage().data_ptr() for t in caches)
    for i, t in enumerate(caches):  # no overlap: a write to one cache shows in no other
        t.fill_(i + 1)
    assert all(torch.equal(t, torch.full_like(t, i + 1)) for i, t in enumerate(caches))


def test_huge_pages_can_be_turned_off(monkeypatch):
    import torch

    monkeypatch.setenv("PAGEDLLM_NO_HUGE_PAGES", "1")
    assert not host_memory.advise_huge_pages(torch.empty(4 << 20, dtype=torch.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux only")
def test_copy_to_huge_pages_keeps_values_shapes_and_alignment(monkeypatch):
    import torch

    monkeypatch.delenv("PAGEDLLM_NO_HUGE_PAGES", raising=False)
    src = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.int64), torch.randn(1000, 33)]
    copies = host_memory.copy_to_huge_pages(src)
    assert copies is not None
    for a, b in zip(src, copies, strict=True):
        assert b.shape == a.shape and b.dtype == a.dtype and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    # one buffer: the copies follow each other in order
    assert copies[0].data_ptr() < copies[1].data_ptr() < copies[2].data_ptr()
    monkeypatch.setenv("PAGEDLLM_NO_HUGE_PAGES", "1")
    assert host_memory.copy_to_huge_pages(src) is None


def test_periodic_heap_release_trims_at_most_once_per_interval():
    now = [0.0]
    trims = []
    release = host_memory.PeriodicHeapRelease(
        interval_s=60.0, release=lambda: trims.append(now[0]) or True, clock=lambda: now[0]
    )
    for t in (1.0, 59.9, 60.0, 61.0, 119.9, 120.0, 500.0):
        now[0] = t
        release.maybe_release()
    assert trims == [60.0, 120.0, 500.0]
    assert release.releases == 3


_FRAGMENTED_HEAP_PROBE = """
import resource, sys
from pagedllm import host_memory

def rss_mib():
    return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() / 2**20

assert host_memory.keep_freed_memory_in_heap()
chunks = [bytearray(1 << 20) for _ in range(200)]  # 200 MiB on the heap (below the mmap threshold)
pin = bytearray(1 << 10)  # above them: the heap's top cannot shrink past it
del chunks
before = rss_mib()
assert host_memory.release_freed_heap()
print(before - rss_mib())
"""


def test_release_freed_heap_returns_freed_memory_below_the_heap_top():
    """What PeriodicHeapRelease relies on: with the thresholds that keep freed memory in the heap,
    memory freed under a live block stays resident until malloc_trim hands its pages back."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc_trim only")
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP_PROBE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 150  # MiB of the 200 freed
