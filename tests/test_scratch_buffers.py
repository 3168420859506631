"""The kernels' pool of large output buffers (kernels/scratch_buffers.h): a live output never
shares memory with another, a dead one's buffer is taken again by the next output that fits, small
outputs stay out of the pool, and the periodic release empties it."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pagedllm.host_memory import release_idle_memory
from pagedllm.kernels import load_cpu_kernels, release_kernel_scratch

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")
MIN_BYTES = 4 << 20  # scratch_buffers.h kScratchMinBytes


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture(autouse=True)
def empty_pool():
    """Each test starts from an empty pool: outputs of earlier tests that a garbage collection
    frees later would otherwise land in it mid-test."""
    gc.collect()
    release_kernel_scratch()
    gc.disable()
    yield
    gc.enable()


def big_input(seed: int, rows: int = 512, inner: int = 4096) -> torch.Tensor:
    """A [rows, 2 * inner] gate_up whose silu_and_mul output is rows * inner * 4 bytes (8 MiB)."""
    return torch.randn(rows, 2 * inner, generator=torch.Generator().manual_seed(seed))


def test_live_outputs_never_share_and_dead_ones_are_reused():
    xa, xb, xc = big_input(0), big_input(1), big_input(2)
    a = kernels.silu_and_mul(xa)
    b = kernels.silu_and_mul(xb)  # while a is alive
    assert a.untyped_storage().nbytes() >= MIN_BYTES
    assert a.data_ptr() != b.data_ptr()
    torch.testing.assert_close(a, silu_mul_reference(xa), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, silu_mul_reference(xb), rtol=1e-5, atol=1e-6)
    a_ptr = a.data_ptr()
    assert kernels.scratch_idle_bytes() == 0
    del a
    assert kernels.scratch_idle_bytes() >= MIN_BYTES  # a's buffer went back to the pool
    c = kernels.silu_and_mul(xc)
    assert c.data_ptr() == a_ptr  # and the next output of its size took it
    torch.testing.assert_close(c, silu_mul_reference(xc), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, silu_mul_reference(xb), rtol=1e-5, atol=1e-6)  # untouched by c


def test_small_outputs_stay_out_of_the_pool_and_release_empties_it():
    small = kernels.silu_and_mul(big_input(3, rows=4))
    del small
    assert kernels.scratch_idle_bytes() == 0
    big = kernels.silu_and_mul(big_input(4))
    del big
    idle = kernels.scratch_idle_bytes()
    assert idle >= MIN_BYTES
    assert release_idle_memory() in (True, False)  # the engine's periodic release: scratch, then the heap
    assert kernels.scratch_idle_bytes() == 0


def test_a_much_smaller_output_does_not_take_a_large_buffer():
    """A buffer is reused only by an output of at least half its size: a pool of large buffers
    never serves small outputs while the large ones are needed."""
    big = kernels.silu_and_mul(big_input(5, rows=2048))  # 32 MiB
    big_ptr = big.data_ptr()
    del big
    smaller = kernels.silu_and_mul(big_input(6, rows=512))  # 8 MiB
    assert smaller.data_ptr() != big_ptr
    torch.testing.assert_close(smaller, silu_mul_reference(big_input(6, rows=512)), rtol=1e-5, atol=1e-6)
    del smaller
    assert release_kernel_scratch() >= 40 << 20
