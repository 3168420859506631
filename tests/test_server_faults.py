"""Issue 22 through the real server: one bad request's blast radius, /health, a dying engine."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import ServerProcess

TRIGGER = 2  # a token id no innocent prompt holds
HERE = os.path.dirname(__file__)


def fault_env(**kw: str) -> dict:
    return {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), **kw}


@pytest.fixture(scope="module")
def flag(tmp_path_factory):
    return str(tmp_path_factory.mktemp("faults") / "fail-every-step")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory, flag):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("faults") / "server.log"),
        module="fault_server",
        env=fault_env(PAGEDLLM_TEST_FAIL_TOKEN=str(TRIGGER), PAGEDLLM_TEST_FAIL_FILE=flag),
    )
    yield srv
    srv.stop()


def complete(server: ServerProcess, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=60)


INNOCENT = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


def test_bad_request_fails_alone_with_a_generic_500(server):
    clean = [complete(server, p).json()["choices"][0]["text"] for p in INNOCENT]
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(complete, server, p) for p in INNOCENT]
        bad = pool.submit(complete, server, [5, TRIGGER, 7])
        got = [f.result() for f in futs]
        r = bad.result()
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "secret" not in r.text and "RuntimeError" not in r.text
    assert [g.status_code for g in got] == [200] * len(INNOCENT)
    assert [g.json()["choices"][0]["text"] for g in got] == clean
    s = server.wait_idle()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_step_errors"] >= 2
    assert httpx.get(server.url("/health")).status_code == 200
    assert "secret internal detail" in server.log_tail(1_000_000)  # the details are logged


def test_health_is_503_while_every_step_fails_and_recovers(server, flag):
    open(flag, "w").close()
    try:
        for p in INNOCENT[:3]:
            r = complete(server, p)
            assert r.status_code == 500 and "secret" not in r.text, r.text
        h = httpx.get(server.url("/health"))
        assert h.status_code == 503 and "failed" in h.json()["error"]["message"]
    finally:
        os.remove(flag)
    assert complete(server, INNOCENT[0]).status_code == 200
    assert httpx.get(server.url("/health")).status_code == 200
    s = server.wait_idle()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_server_exits_nonzero_when_the_engine_thread_dies(tiny_llama, tmp_path):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path / "server.log"),
        module="fault_server",
        env=fault_env(PAGEDLLM_TEST_CRASH_TOKEN=str(TRIGGER)),
    )
    try:
        try:
            r = complete(srv, [5, TRIGGER])
            assert r.status_code in (500, 503) and "injected" not in r.text, r.text
        except httpx.HTTPError:
            pass  # the server may be gone before it answers
        deadline = time.monotonic() + 30
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.proc.returncode not in (None, 0), srv.log_tail()
    finally:
        srv.stop()
