"""Schemathesis fuzz of the server's own OpenAPI document (issue 22): every operation, valid and
invalid requests generated from the schema, every check Schemathesis has except the ones named in
EXCLUDED_CHECKS (each with the reason a streaming LLM API legitimately breaks it). Asserts no 5xx
and no response outside the document (status codes, content types, headers, JSON bodies).

Short by default (CI); longer by hand:

    PAGEDLLM_FUZZ_EXAMPLES=500 flock /tmp/pagedllm-bench.lock python3 -m pytest -q tests/test_openapi_fuzz.py
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import positive_data_acceptance
from test_server import ServerProcess

MAX_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "30"))

# Why each check is left out; everything else in `--checks all` runs.
EXCLUDED_CHECKS = {
    # "A schema-valid request must be accepted": generation requests are valid by JSON Schema yet
    # refused on what no schema can say: the prompt's tokens plus max_tokens against the context
    # length and the KV cache, token ids against the vocabulary, min_tokens <= max_tokens,
    # best_of >= n and not streamed, top_logprobs only with logprobs, an empty prompt. Each of
    # those is a 400 naming the field, which is what the bad-input suite asserts.
    positive_data_acceptance,
}


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("openapi_fuzz") / "server.log"),
        "--served-model-name",
        "tiny",
        # Most generated requests leave max_tokens out: the rest of the context. A 64-token
        # context keeps each to ~50 steps (the fuzz stays well under a minute) and still reaches
        # the context-length and tokens-in-flight 400s.
        "--max-model-len",
        "64",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"))


schema = schemathesis.pytest.from_fixture("api_schema")


def all_checks_but_excluded() -> list:
    load_all_checks()
    checks = [c for c in CHECKS.get_all() if c not in EXCLUDED_CHECKS]
    assert len(checks) >= 10, checks  # the registry was found, not an empty list that checks nothing
    return checks


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_openapi_fuzz(case, fuzz_server):
    response = case.call_and_validate(checks=all_checks_but_excluded(), timeout=60)
    assert response.status_code < 500, response.text


def test_fuzz_left_the_server_healthy_and_clean(fuzz_server):
    # Runs after the fuzz (file order): every generated request answered, nothing leaked.
    import httpx

    assert httpx.get(fuzz_server.url("/health"), timeout=10).status_code == 200
    stats = fuzz_server.wait_idle()
    assert stats["num_step_errors"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
    log = fuzz_server.log_tail(1_000_000)
    assert "Traceback" not in log, log[-4000:]
