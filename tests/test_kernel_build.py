"""The compiled CPU kernels build on every x86 CPU generation they claim to serve, not only this one.

The kernels pick their code path at compile time (AMX tiles, AVX512-BF16, plain C++), so a build
on one machine proves nothing about the others: code outside the AMX guards once referred to
AMX-only constants, the build failed on an AVX512-BF16 machine without AMX, and the engine fell
back to the reference path with only a log line. Each target here is syntax-checked as one
translation unit (a full build of every target would take minutes).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pagedllm.kernels import load_cpu_kernels

KERNEL_DIR = Path(__file__).resolve().parent.parent / "pagedllm" / "kernels"
COMPILER = shutil.which("c++")


def test_kernels_build_where_a_compiler_exists():
    from torch.utils.cpp_extension import is_ninja_available

    if COMPILER is None or not is_ninja_available():
        pytest.skip("no C++ compiler or ninja here: the reference path is the documented fallback")
    assert load_cpu_kernels() is not None, "the CPU kernels failed to build (see the pagedllm warning in the log)"


# AMX + AVX512-BF16 (Sapphire Rapids), AVX512-BF16 without AMX (Cooper Lake: the ISA of AMD Zen 4, a
# name older compilers know), no AVX512 at all.
@pytest.mark.parametrize("march", ["sapphirerapids", "cooperlake", "x86-64-v3"])
def test_kernels_compile_for_each_cpu_generation(march, tmp_path):
    if COMPILER is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler on x86-64")
    from torch.utils.cpp_extension import include_paths

    unit = tmp_path / "all_kernels.cpp"
    unit.write_text("".join(f'#include "{p}"\n' for p in sorted(KERNEL_DIR.glob("*.cpp"))))
    includes = [arg for p in include_paths() for arg in ("-isystem", p)]
    cmd = [
        COMPILER, "-fsyntax-only", "-std=c++20", f"-march={march}", "-fopenmp",
        *includes, "-isystem", sysconfig.get_paths()["include"],
        "-DTORCH_EXTENSION_NAME=syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H", str(unit),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    unknown_target = ("bad value" in result.stderr or "unrecognized" in result.stderr) and march in result.stderr
    if result.returncode != 0 and unknown_target:
        pytest.skip(f"this compiler does not know -march={march}")
    assert result.returncode == 0, result.stderr[-4000:]


def test_paths_without_amx_also_run_on_amx_machines():
    """On a CPU with AMX the decode and prefill attention kernels and the GEMMs take their AMX
    paths, so the AVX512-BF16 paths that CPUs without AMX run (AMD Zen 4) would go untested
    there: run the kernel-vs-reference tests again in a process where PAGEDLLM_NO_AMX=1."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.amx_available():
        pytest.skip("no AMX here: the other tests already run the paths without AMX")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PAGEDLLM_NO_AMX": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(tests / "test_attention.py"), str(tests / "test_cpu_kernels.py")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tests.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed midway leaves torch's lock file; without this every later start waits forever."""
    import time

    from pagedllm import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age, kept in (("stale_build", 3600, False), ("live_build", 5, True)):
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        t = time.time() - age
        os.utime(lock, (t, t))
        kernels._remove_stale_build_lock(name)
        assert lock.exists() == kept
