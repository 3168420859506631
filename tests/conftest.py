"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import FAMILIES, build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {fam: build_model(fam, str(root / fam)) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


# Narrower than most test prompts: attention and block release run their sliding-window paths.
TINY_WINDOW = 12


@pytest.fixture(scope="session")
def tiny_mistral_windowed(tmp_path_factory) -> str:
    """Tiny Mistral whose layers attend through a TINY_WINDOW-token sliding window."""
    return build_model("mistral", str(tmp_path_factory.mktemp("tiny_models") / "mistral_w"), sliding_window=TINY_WINDOW)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny-model runs (``pytestmark = pytest.mark.usefixtures(...)``): a tiny
    model is far faster on one thread, and on a busy 2-core machine two threads crawl."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def kernel_paths_line() -> str:
    """Which CPU and which compiled kernel paths this run tests (the lower levels run in
    tests/test_kernel_build.py's subprocesses)."""
    from pagedllm.kernels import load_cpu_kernels
    from pagedllm.kernels.build import cpu_model, levels_here, selected_level

    kernels = load_cpu_kernels()
    built = kernels.compiled_isa() if kernels is not None else "not built: the reference path only"
    return (
        f"cpu: {cpu_model()}; kernels: PAGEDLLM_ISA={selected_level()} ({built}); "
        f"levels this machine runs: {', '.join(levels_here())}"
    )


# "LEVEL: pytest's last line" of each lower instruction-set level's kernel test run
KERNEL_LEVEL_RESULTS: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    # summary lines, not a report header: -q (the README's command) hides the header
    terminalreporter.write_line(kernel_paths_line())
    for line in KERNEL_LEVEL_RESULTS:
        terminalreporter.write_line(f"kernel tests at PAGEDLLM_ISA={line}")
