"""Bad input gets a 4xx in OpenAI's error shape with a clear message, never a 5xx; the server lives on."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from test_server import ServerProcess

MODEL = "tiny"
MAX_MODEL_LEN = 512  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama, str(tmp_path_factory.mktemp("bad_input") / "server.log"), "--served-model-name", MODEL
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    for n in needles:
        assert n.lower() in err["message"].lower(), (n, err["message"])
    if param != "any":
        assert err["param"] == param, err
    return err


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path,body,needles,param",
    [
        # malformed JSON / wrong shapes
        ("/v1/completions", b'{"prompt": "hi",', ["JSON"], None),
        ("/v1/completions", b"", ["JSON object"], None),
        ("/v1/completions", b"[1, 2]", ["dictionary"], None),
        ("/v1/completions", b"not json at all", ["JSON"], None),
        # wrong types
        ("/v1/completions", {**COMPLETION, "max_tokens": "abc"}, ["max_tokens", "integer"], "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}, ["temperature"], "temperature"),
        ("/v1/completions", {**COMPLETION, "prompt": {"text": "hi"}}, ["prompt"], "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1.5, 2]}, ["prompt"], "prompt"),
        ("/v1/completions", {**COMPLETION, "stop": 5}, ["stop"], "stop"),
        ("/v1/completions", {**COMPLETION, "stream_options": "yes"}, ["stream_options"], "stream_options"),
        ("/v1/completions", {"model": MODEL}, ["prompt", "required"], "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, ["messages"], "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, ["role"], "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, ["messages"], "messages"),
        # bad values (SamplingParams names the field)
        ("/v1/completions", {**COMPLETION, "max_tokens": -1}, ["max_tokens", "-1"], "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, ["max_tokens"], "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": -0.5}, ["temperature", ">= 0"], "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, ["top_p"], "top_p"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, ["top_p"], "top_p"),
        ("/v1/completions", {**COMPLETION, "top_k": -3}, ["top_k"], "top_k"),
        ("/v1/completions", {**COMPLETION, "min_p": 2}, ["min_p"], "min_p"),
        ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, ["presence_penalty"], "presence_penalty"),
        (
            "/v1/completions",
            {**COMPLETION, "frequency_penalty": -3},
            ["frequency_penalty"],
            "frequency_penalty",
        ),
        (
            "/v1/completions",
            {**COMPLETION, "repetition_penalty": 0},
            ["repetition_penalty"],
            "repetition_penalty",
        ),
        ("/v1/completions", {**COMPLETION, "n": 0}, ["n must"], "n"),
        ("/v1/completions", {**COMPLETION, "logprobs": 99}, ["logprobs"], "logprobs"),
        ("/v1/completions", {**COMPLETION, "best_of": 2**64}, ["best_of"], "best_of"),
        ("/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, ["best_of"], "best_of"),
        ("/v1/completions", {**COMPLETION, "n": 10**6}, ["n must"], "n"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 5}, ["min_tokens"], "min_tokens"),
        ("/v1/completions", {**COMPLETION, "stop": [""]}, ["stop"], "stop"),
        ("/v1/completions", {**COMPLETION, "seed": 2**70}, ["seed"], "seed"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, ["prompt"], "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [[]]}, ["prompt"], "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, ["empty"], None),
        ("/v1/completions", {**COMPLETION, "prompt": [5, 99999]}, ["out of range", "99999"], None),
        ("/v1/completions", {**COMPLETION, "prompt": [5, -1]}, ["out of range"], None),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": -1}, ["prompt_logprobs"], "prompt_logprobs"),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, ["prompt_logprobs", "20"], "prompt_logprobs"),
        ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 99}, ["logprobs"], "logprobs"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, ["temperature"], "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, ["logprobs"], "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, ["logprobs"], "logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, ["max_tokens"], "max_tokens"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            ["image_url"],
            "messages",
        ),
    ],
)
def test_bad_request_is_400(http, path, body, needles, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = assert_error(r, 400, *needles, param=param)
    assert err["type"] == "invalid_request_error"


def test_prompt_too_long_names_the_numbers(http):
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": [7] * 600})
    assert_error(r, 400, "600", str(MAX_MODEL_LEN))
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": [7] * 500, "max_tokens": 100})
    err = assert_error(r, 400, "600", "500", "100", str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "fox " * 600}]})
    assert_error(r, 400, str(MAX_MODEL_LEN))
    # one bad prompt in a batch rejects the whole request, and queues nothing
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": [[1, 2], [7] * 600]})
    assert_error(r, 400, "600")


def test_json_integers_are_valid_floats(http):
    # Strict types must not reject what OpenAI accepts: 0 and 1 are numbers for float fields.
    body = {**COMPLETION, "temperature": 0, "top_p": 1, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**CHAT, "temperature": 1, "frequency_penalty": 0})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_refused_harmless_ones_ignored(http):
    # A field the server cannot honour is a 400 naming it, never silently dropped.
    r = http.post("/v1/completions", json={**COMPLETION, "not_a_field": {"x": [1]}, "user": "u1"})
    assert_error(r, 400, "not_a_field", param="not_a_field")
    r = http.post("/v1/completions", json={**COMPLETION, "user": "u1", "store": False})
    assert r.status_code == 200, r.text
    r = http.post(
        "/v1/chat/completions",
        json={**CHAT, "metadata": {"a": "b"}, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "whatever": 1}), 400, "whatever", param="whatever")


def test_unknown_model_is_404(http, server):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = assert_error(http.post(path, json={**body, "model": "gpt-17"}), 404, "gpt-17", param="model")
        assert err["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)
    assert_error(http.get("/v1/no-such-route"), 404)


def test_huge_body_is_413(http):
    huge = json.dumps({**COMPLETION, "prompt": "a" * (9 * 2**20)}).encode()
    err = assert_error(
        http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}),
        413,
        "too large",
        str(8 * 2**20),
    )
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold on the bytes actually sent
        for i in range(0, len(huge), 2**20):
            yield huge[i : i + 2**20]

    assert_error(
        http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
        413,
        "too large",
    )
    # just under the limit passes the size check; the prompt is then too long (said before tokenizing
    # 7 MiB, which would take many seconds)
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": "a" * (7 * 2**20)})
    assert_error(r, 400, "characters", str(MAX_MODEL_LEN))


def test_fuzzed_fields_never_5xx(http):
    rng = random.Random(0)
    values = [None, True, -1, 0, 2**64, -1e308, 1e308, float("nan"), "", "x" * 50, [], [1, "a"], {"a": 1}]
    fields = [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "best_of",
        "seed",
        "stop",
        "stop_token_ids",
        "logprobs",
        "prompt_logprobs",
        "echo",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "stream",
        "stream_options",
        "user",
        "model",
        "skip_special_tokens",
        "suffix",
    ]
    statuses = set()
    for f in fields:
        for v in values:
            body = json.dumps({**COMPLETION, "max_tokens": 1, f: v}, allow_nan=True)
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            statuses.add(r.status_code)
            assert r.status_code < 500, (f, v, r.status_code, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["message"]
    chat_fields = [
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "chat_template_kwargs",
    ]
    for f in chat_fields:
        for v in rng.sample(values, 8):
            body = json.dumps({**CHAT, "max_tokens": 1, f: v}, allow_nan=True)
            r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code < 500, (f, v, r.status_code, r.text)
    assert 200 in statuses and 400 in statuses


def test_server_healthy_and_clean_afterwards(http, server):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    s = server.wait_idle()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_step_errors"] == 0
    assert "Traceback" not in server.log_tail(1_000_000), server.log_tail()


# ---- issue 22: every bad input is a 4xx naming the field, and the server serves the next request ----
def _deep(n: int) -> list:
    v: list = []
    for _ in range(n):
        v = [v]
    return v


SURROGATE = '"\\ud800"'  # valid JSON, but not valid Unicode: a lone UTF-16 surrogate


def _raw(template: str) -> bytes:
    return template.replace("SUR", SURROGATE).encode()


HARDENING_CASES = [
    # lone surrogates, in every string field that reaches the tokenizer or the response
    ("/v1/completions", _raw('{"model": SUR, "prompt": "hi"}'), ["unicode"], "model"),
    ("/v1/completions", _raw('{"prompt": SUR, "max_tokens": 2}'), ["unicode"], "prompt"),
    ("/v1/completions", _raw('{"prompt": ["ok", SUR], "max_tokens": 2}'), ["unicode"], "prompt"),
    ("/v1/completions", _raw('{"prompt": "hi", "stop": [SUR]}'), ["unicode"], "stop"),
    ("/v1/completions", _raw('{"prompt": "hi", "user": SUR}'), ["unicode"], "user"),
    ("/v1/completions", _raw('{"prompt": "hi", "unknown_field": {"x": SUR}}'), ["unicode"], "unknown_field"),
    ("/v1/completions", _raw("SUR"), ["unicode"], None),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": SUR}]}'), ["unicode"], "messages"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": SUR, "content": "hi"}]}'), ["unicode"], "messages"),
    (
        "/v1/chat/completions",
        _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": SUR}]}]}'),
        ["unicode"],
        "messages",
    ),
    (
        "/v1/chat/completions",
        _raw('{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": SUR}}'),
        ["unicode"],
        "chat_template_kwargs",
    ),
    # bytes that are not UTF-8 at all
    ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', [], None),
    # non-finite and huge numbers
    ("/v1/completions", {**COMPLETION, "temperature": 1e39}, ["temperature", "2"], "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": 2.5}, ["temperature"], "temperature"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 1e-40}, ["repetition_penalty"], "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 1e30}, ["repetition_penalty"], "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', ["temperature", "finite"], "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', ["top_p", "finite"], "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "min_p": -Infinity}', ["min_p"], "min_p"),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 1e400}', ["presence_penalty"], "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "top_k": 2**40}, ["top_k"], "top_k"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**63}, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [2**40]}, ["stop_token_ids"], "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 2**40, "max_tokens": None}, ["min_tokens"], "min_tokens"),
    # min_tokens against max_tokens after its default (the rest of the context)
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "min_tokens": 10_000}, ["min_tokens"], "min_tokens"),
    # wrong types
    ("/v1/completions", {**COMPLETION, "stop_token_ids": ["a"]}, ["stop_token_ids"], "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, ["messages"], "messages"),
    # strict JSON types: no lax coercion of strings, floats or bools into ints, floats and bools
    ("/v1/completions", {**COMPLETION, "n": "2"}, ["n", "integer", "'2'"], "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "5"}, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2.0}, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": True}, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/completions", {**COMPLETION, "seed": "7"}, ["seed", "integer"], "seed"),
    ("/v1/completions", {**COMPLETION, "top_k": 5.5}, ["top_k", "integer"], "top_k"),
    ("/v1/completions", {**COMPLETION, "logprobs": "1"}, ["logprobs", "integer"], "logprobs"),
    ("/v1/completions", {**COMPLETION, "best_of": False}, ["best_of", "integer"], "best_of"),
    ("/v1/completions", {**COMPLETION, "temperature": "0.5"}, ["temperature", "number"], "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": True}, ["top_p", "number"], "top_p"),
    ("/v1/completions", {**COMPLETION, "echo": "false"}, ["echo", "boolean"], "echo"),
    ("/v1/completions", {**COMPLETION, "stream": 1}, ["stream", "boolean"], "stream"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, ["ignore_eos", "boolean"], "ignore_eos"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": ["3"]}, ["stop_token_ids"], "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "prompt": ["1", 2]}, ["prompt"], "prompt"),
    (
        "/v1/completions",
        {**COMPLETION, "stream": True, "stream_options": {"include_usage": "true"}},
        ["stream_options", "boolean"],
        "stream_options",
    ),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, ["logprobs", "boolean"], "logprobs"),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": "4"},
        ["max_completion_tokens"],
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 1.0}, ["top_logprobs"], "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": 0}, ["add_generation_prompt"], "add_generation_prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 1, "content": "hi"}]}, ["messages"], "messages"),
    # caps (server flags with defaults)
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 257}, ["256"], "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 100, "n": 11}, ["1024"], "n"),
    ("/v1/completions", {**COMPLETION, "stop": ["s"] * 65}, ["stop", "64"], "stop"),
    ("/v1/completions", {**COMPLETION, "stop": "x" * 1025}, ["stop", "1024"], "stop"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [1] * 1025}, ["stop_token_ids", "1024"], "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 2049}, ["2048"], "messages"),
    # tokens in flight: 100 sequences of the whole context need more than the 256-block KV cache
    ("/v1/completions", {**COMPLETION, "max_tokens": None, "n": 100}, ["tokens"], "max_tokens"),
    # deep nesting
    ("/v1/completions", {**COMPLETION, "unknown": _deep(100)}, ["nested"], "unknown"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": _deep(50)}}, ["nested"], "chat_template_kwargs"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, [], None),
]


@pytest.fixture(scope="module")
def good_outputs(http):
    """Greedy outputs of one completion and one chat request, before any bad input."""
    return _good(http)


def _good(http) -> tuple[str, str]:
    c = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    m = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert c.status_code == 200 and m.status_code == 200, (c.text, m.text)
    return c.json()["choices"][0]["text"], m.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,body,needles,param", HARDENING_CASES, ids=lambda v: repr(v)[:60])
def test_hardening_bad_input_is_400_and_server_lives(http, good_outputs, path, body, needles, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    err = assert_error(r, 400, *needles, param=param if needles else "any")
    assert "Traceback" not in err["message"] and "Error:" not in err["message"], err
    assert _good(http) == good_outputs


def test_host_header_allow_list_on_a_keyless_loopback_server(http):
    # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends its own host name.
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = http.get("/v1/models", headers={"host": host})
        assert_error(r, 400, "host")
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_limits_are_server_flags(tiny_llama, tmp_path):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path / "server.log"),
        "--served-model-name",
        MODEL,
        "--max-prompts-per-request",
        "2",
        "--max-stop-strings",
        "1",
        "--max-messages",
        "1",
        "--max-request-tokens",
        "20",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            assert_error(c.post("/v1/completions", json={**COMPLETION, "prompt": ["a"] * 3}), 400, param="prompt")
            assert_error(c.post("/v1/completions", json={**COMPLETION, "stop": ["a", "b"]}), 400, param="stop")
            two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
            assert_error(c.post("/v1/chat/completions", json={**CHAT, "messages": two}), 400, param="messages")
            assert_error(c.post("/v1/completions", json={**COMPLETION, "max_tokens": 30}), 400, "20")
            assert (
                c.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "stop": ["x"]}).status_code == 200
            )
    finally:
        srv.stop()
