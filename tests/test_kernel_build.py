"""The compiled CPU kernels build on every x86 CPU generation they claim to serve, not only this one,
and every instruction-set level this machine can run passes the kernel tests.

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
from conftest import KERNEL_LEVEL_RESULTS

from pagedllm.kernels import load_cpu_kernels
from pagedllm.kernels.build import cpu_flags, levels_here

KERNEL_DIR = Path(__file__).resolve().parent.parent / "pagedllm" / "kernels"
COMPILER = shutil.which("c++")


def test_kernels_build_where_a_compiler_exists():
    from torch.utils.cpp_extension import is_ninja_available

    if COMPILER is None or not is_ninja_available():
        pytest.skip("no C++ compiler or ninja here: the reference path is the documented fallback")
    assert load_cpu_kernels() is not None, "the CPU kernels failed to build (see the pagedllm warning in the log)"


# AMX + AVX512-BF16 (Sapphire Rapids), AVX512-BF16 without AMX (Cooper Lake: the ISA of AMD Zen 4, a
# name older compilers know), AVX-VNNI without AVX512 (Alder Lake), no AVX512 or VNNI at all.
@pytest.mark.parametrize("march", ["sapphirerapids", "cooperlake", "alderlake", "x86-64-v3"])
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


def test_a_killed_build_never_blocks_the_next_start(tmp_path):
    """A build killed midway (an interrupted first start) must not make later starts wait: the
    build lock is an flock, which the kernel releases when its holder dies."""
    import signal
    import time

    from pagedllm.kernels.build import BuildLock

    lock = tmp_path / "build.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; from pagedllm.kernels.build import BuildLock\n"
         f"with BuildLock(Path({str(lock)!r})):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        start = time.monotonic()
        with BuildLock(lock):
            pass
        assert time.monotonic() - start < 2
    finally:
        holder.kill()


def test_builds_are_keyed_on_level_torch_build_and_cpu(monkeypatch):
    """Two Python environments (two torch installs) or two CPU kinds sharing a cache must not
    rebuild each other's kernels: each gets a build of its own."""
    import torch

    from pagedllm.kernels import build

    keys = {level: build.build_key(level) for level in build.ISA_LEVELS}
    assert len(set(keys.values())) == len(keys)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert build.build_key("avx2") != keys["avx2"]
    monkeypatch.undo()
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma"})
    assert build.build_key("native") != keys["native"]
    assert build.build_key("avx2") == keys["avx2"]  # a fixed -march does not depend on the CPU


def test_isa_switch_is_validated(monkeypatch):
    from pagedllm.kernels.build import selected_level

    monkeypatch.setenv("PAGEDLLM_ISA", "avx9000")
    with pytest.raises(ValueError, match="PAGEDLLM_ISA"):
        selected_level()
    monkeypatch.setenv("PAGEDLLM_ISA", "AVX2")
    assert selected_level() == "avx2"


def test_avxvnni_is_refused_where_the_cpu_has_none(monkeypatch):
    """A build for an instruction the CPU lacks dies of SIGILL at the first use: refused by name."""
    from pagedllm.kernels import build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 levels")
    monkeypatch.setenv("PAGEDLLM_ISA", "avxvnni")
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512_vnni"})
    with pytest.raises(ValueError, match="no AVX-VNNI"):
        build.selected_level()
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})
    assert build.selected_level() == "avxvnni"
    # an AVX2-only Intel CPU with AVX-VNNI: its native build is the avxvnni paths, the avx2 level differs
    assert build.levels_here() == ["native", "avx2", "portable"]
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx_vnni"})
    assert build.levels_here() == ["native", "avxvnni", "avx2", "portable"]


LEVELS = levels_here()


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_is_compiled_for_its_instruction_set(level):
    kernels = load_cpu_kernels(level)
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    features = set(kernels.compiled_isa().split())
    if level == "avx2":
        assert "avx2+fma" in features and not any(f.startswith(("avx512", "amx", "avxvnni")) for f in features)
    elif level == "avxvnni":
        assert {"avx2+fma", "avxvnni"} <= features and not any(f.startswith(("avx512", "amx")) for f in features)
    elif level == "portable":
        assert features == {"portable"}
    elif "avx512f" in cpu_flags():
        assert "avx512f" in features


# Every module that checks a kernel against the reference, plus greedy invariance (batching, block
# size, chunking, preemption) and HF fidelity through the kernels.
KERNEL_TEST_MODULES = (
    "test_attention.py",
    "test_cpu_kernels.py",
    "test_int8_kv.py",
    "test_sliding_window_attention.py",
    "test_kernel_bounds.py",
    "test_kernel_shapes.py",
    "test_quantized.py",
    "test_fidelity.py",
)


@pytest.mark.parametrize("level", LEVELS[1:] or [pytest.param("none", marks=pytest.mark.skip("only native here"))])
def test_lower_levels_pass_the_kernel_tests(level):
    """The paths of CPUs below this one (AVX2 without AVX512, plain C++) are compiled out of the
    native build: run the kernel tests again in a process whose engine loads that level's build."""
    if load_cpu_kernels(level) is None:
        pytest.skip("the CPU kernels cannot be built here")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PAGEDLLM_ISA": level}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *(str(tests / m) for m in KERNEL_TEST_MODULES),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tests.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
    KERNEL_LEVEL_RESULTS.append(f"{level}: {result.stdout.strip().splitlines()[-1]}")


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_finished_build_that_no_longer_loads_is_built_again(damage, tmp_path, monkeypatch):
    """A BUILT marker beside a library that does not load (truncated by a full disk, deleted by a
    cache cleaner) used to send every later start to the reference path: the build is redone
    once, under the build lock, and marked finished again."""
    import types

    import torch.utils.cpp_extension

    from pagedllm.kernels import build

    monkeypatch.setenv("PAGEDLLM_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_KERNELS_INCREMENTAL", raising=False)
    name = build.build_name("portable")
    build_dir = tmp_path / name
    build_dir.mkdir()
    (build_dir / "BUILT").write_text("1 s\n")
    if damage == "truncated":
        (build_dir / f"{name}.so").write_bytes(b"\x7fELF")
    rebuilt = types.ModuleType(name)
    calls = []

    def fake_load(**kw):  # stands in for the minutes-long compile
        calls.append(kw["build_directory"])
        return rebuilt

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert build.load_level("portable") is rebuilt
    assert calls == [str(build_dir)]
    assert (build_dir / "BUILT").exists()
