"""Building and loading the compiled CPU kernels: one build per instruction-set level.

The kernels choose their code paths at compile time (AMX tiles, AVX512-BF16, AVX2 + FMA, plain
C++), so each level is a build of its own, compiled with that level's ``-march``:

- ``native``: everything this CPU has (on an AVX512 machine its AVX512 paths, AMX where present);
- ``avxvnni``: x86-64-v3 plus AVX-VNNI, the paths of Intel CPUs without AVX512 (Alder Lake and
  later clients, Sierra Forest): the integer kernels' VNNI dot products on 256-bit registers;
- ``avx2``: x86-64-v3 (AVX2, FMA, F16C), the paths of CPUs without AVX512 or VNNI (AMD Zen 3);
- ``portable``: x86-64 with no vector extension beyond SSE2: the plain C++ paths.

``PAGEDLLM_ISA`` picks the level the engine loads (``native`` unless set), so a machine can run,
and the tests can check, every path below its own.

Why a build cache of our own rather than torch's default JIT directory: a build is keyed on
everything that makes it differ (the sources, the level's flags, the torch build it links against,
the Python, and for ``native`` the CPU's flags), so two Python environments or two CPU kinds never
rebuild each other's kernels; and it is guarded by an ``flock`` the kernel releases when a build
process dies, so a killed build never blocks a later start (torch's own lock is a file that
outlives its process). ``scripts/setup.sh`` builds the ``native`` level at install
(``python3 -m pagedllm.kernels.build``), so the first request never waits for a compiler.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

KERNEL_SOURCE_DIR = Path(__file__).resolve().parent
ISA_LEVELS = ("native", "avxvnni", "avx2", "portable")
# -ffast-math lets gcc call glibc's vectorized expf; the kernels never produce inf or NaN.
COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp"]
_X86 = platform.machine() in ("x86_64", "AMD64")
LEVEL_FLAGS = {
    # 512-bit vectors: gcc defaults to 256 on many Intel targets.
    "native": ["-march=native", "-mprefer-vector-width=512"] if _X86 else ["-mcpu=native"],
    "avxvnni": ["-march=x86-64-v3", "-mavxvnni"],
    "avx2": ["-march=x86-64-v3"],
    "portable": ["-march=x86-64"],
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def levels_here() -> list[str]:
    """The levels this machine can run, its own first: the lower x86 levels only where they
    differ from native (an AVX2-only CPU's native build already is its avx2 paths)."""
    if not _X86:
        return ["native"]
    flags = cpu_flags()
    levels = ["native"]
    avx2 = {"avx2", "fma", "f16c"} <= flags
    if avx2 and "avx_vnni" in flags and "avx512f" in flags:
        levels.append("avxvnni")
    if avx2 and ("avx512f" in flags or "avx_vnni" in flags):
        levels.append("avx2")
    if "avx2" in flags:
        levels.append("portable")
    return levels


def selected_level() -> str:
    """The level the engine loads: PAGEDLLM_ISA, or native."""
    level = os.environ.get("PAGEDLLM_ISA", "native").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"PAGEDLLM_ISA={level!r}: expected one of {', '.join(ISA_LEVELS)}")
    if level != "native" and not _X86:
        raise ValueError(f"PAGEDLLM_ISA={level!r} names an x86 level; this machine is {platform.machine()}")
    if level == "avxvnni" and "avx_vnni" not in cpu_flags():
        raise ValueError("PAGEDLLM_ISA='avxvnni': this CPU has no AVX-VNNI (its build stops at the first vpdpbusd)")
    return level


def _sources() -> list[Path]:
    return sorted(p for p in KERNEL_SOURCE_DIR.iterdir() if p.suffix == ".cpp")


def build_key(level: str) -> str:
    """What makes one build differ from another: the sources (headers too: torch rebuilds only
    when a .cpp changes), the flags, the torch build and Python it links against, and for native
    the CPU it was tuned for."""
    import torch

    h = hashlib.sha256()
    for p in sorted(KERNEL_SOURCE_DIR.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join(COMMON_FLAGS + LEVEL_FLAGS[level]).encode())
    h.update(f"{torch.__version__}|{Path(torch.__file__).resolve().parent}|{sys.version}".encode())
    if level == "native":
        h.update(" ".join(sorted(cpu_flags())).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_KERNEL_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedllm" / "kernels"


def build_name(level: str) -> str:
    if os.environ.get("PAGEDLLM_KERNELS_INCREMENTAL") == "1":
        # Kernel development: one build directory per checkout and level, so ninja recompiles
        # only the sources that changed (a full build is minutes on 2 cores).
        checkout = hashlib.sha256(str(KERNEL_SOURCE_DIR).encode()).hexdigest()[:10]
        return f"pagedllm_kernels_dev_{level}_{checkout}"
    return f"pagedllm_kernels_{level}_{build_key(level)}"


class BuildLock:
    """An exclusive flock on ``path``: held while a build runs, released by the kernel when the
    process that holds it exits or dies (a killed build never blocks the next start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> BuildLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("pagedllm: waiting for another process's kernel build (%s)", self.path)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _import(name: str, build_dir: Path) -> ModuleType:
    so = next(build_dir.glob(f"{name}*.so"))
    spec = importlib.util.spec_from_file_location(name, so)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_built(name: str, build_dir: Path, done: Path) -> ModuleType | None:
    """The finished build's module, or None (and the build marked unfinished) when it does not
    load: a library truncated or deleted since (a full disk, a cache cleaner) would otherwise
    send every later start to the slow reference path, with nothing that rebuilds it."""
    try:
        return _import(name, build_dir)
    except (ImportError, OSError, StopIteration) as e:
        logger.warning("pagedllm: the kernel build in %s does not load (%s); building it again", build_dir, e)
        done.unlink(missing_ok=True)
        return None


def load_level(level: str, verbose: bool = False) -> ModuleType:
    """The compiled kernel module of ``level``, built first if this machine has no build of it
    (or its build no longer loads)."""
    name = build_name(level)
    build_dir = cache_root() / name
    done = build_dir / "BUILT"  # written after a build that finished: a killed one leaves none
    incremental = name.startswith("pagedllm_kernels_dev_")
    if done.exists() and not incremental and (module := _import_built(name, build_dir, done)) is not None:
        return module
    with BuildLock(cache_root() / f"{name}.lock"):
        if done.exists() and not incremental and (module := _import_built(name, build_dir, done)) is not None:
            return module  # another process built it while we waited
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's own lock file is left behind by a killed build; holding ours, nobody else builds.
        (build_dir / "lock").unlink(missing_ok=True)
        logger.warning("pagedllm: compiling the CPU kernels (%s level, once per machine; minutes)", level)
        start = time.perf_counter()
        module = load(
            name=name,
            sources=[str(p) for p in _sources()],
            extra_cflags=COMMON_FLAGS + LEVEL_FLAGS[level],
            build_directory=str(build_dir),
            verbose=verbose,
        )
        done.write_text(f"{time.perf_counter() - start:.0f} s\n")
        return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m pagedllm.kernels.build", description="Build the compiled CPU kernels ahead of first use."
    )
    parser.add_argument(
        "--isa",
        default="native",
        choices=(*ISA_LEVELS, "all"),
        help="level to build (all: every level this machine runs)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for level in levels_here() if args.isa == "all" else [args.isa]:
        start = time.perf_counter()
        module = load_level(level, args.verbose)
        print(f"pagedllm kernels, {level}: {module.compiled_isa()} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
