"""The CLI's allocator set-up: re-exec under tcmalloc once when installed, never loop."""

from __future__ import annotations

import os
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
