"""The server as a drop-in for vLLM's: request fields, /tokenize and /detokenize, /v1/models,
vLLM's metric names (--metrics-prefix vllm) and the model's generation-config defaults."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from test_server import ServerProcess
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.sampling import to_sampling_params

MODEL = "tiny-vllm"
KEY = "sk-compat"
MAX_NEW_TOKENS = 5  # the model's generation_config.json
GEN_CONFIG = {"do_sample": True, "temperature": 0.6, "top_k": 7, "max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": 0}
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
# --chat-template, inline: replaces the tokenizer's for /v1/chat/completions and /tokenize alike
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tiny_llama, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("compat") / "model")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GEN_CONFIG, f)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(
        model_dir,
        str(tmp_path_factory.mktemp("compat_log") / "server.log"),
        "--served-model-name",
        MODEL,
        "--metrics-prefix",
        "vllm",
        "--api-key",
        KEY,
        "--enforce-eager",
        "--swap-space",
        "1",
        "--disable-log-requests",
        "--chat-template",
        TEMPLATE,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}


def assert_error(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for n in needles:
        assert n in err["message"], err


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_unknown_request_field_is_a_400_naming_it(http, path, body):
    r = http.post(path, json={**body, "frobnicate": 1})
    assert_error(r, 400, "frobnicate", "'frobnicate'")
    r = http.post(path, json={**body, "zz_one": 1, "aa_two": {}})
    assert_error(r, 400, "zz_one", "'zz_one'", "'aa_two'")


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_harmless_openai_fields_are_accepted(http, path, body):
    extra = {
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "prompt_cache_key": "c",
        "safety_identifier": "s",
    }
    r = http.post(path, json={**body, **extra})
    assert r.status_code == 200, r.text


def test_tokenize_round_trip(http, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    r = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert r.json()["prompt"] == text


def test_tokenize_messages_matches_the_chat_endpoint(http, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, chat_template=TEMPLATE)
    assert rendered == "<|im_start|>The quick brown fox<|im_end|>"
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    chat = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenize_bad_input(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenize_needs_the_key(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(server.url(path), json=body).status_code == 401


def test_models_root_is_not_a_path(http, model_dir):
    (entry,) = http.get("/v1/models").json()["data"]
    assert entry["id"] == MODEL and entry["root"] == MODEL
    assert model_dir not in json.dumps(entry)


def test_generation_config_defaults(http):
    # The model's max_new_tokens caps what a request leaves out or asks more than.
    chat = {"model": MODEL, "messages": MESSAGES, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=chat).json()
    assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS and r["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 3


def test_generation_defaults_fill_only_unset_fields():
    defaults = {"temperature": 0.6, "top_k": 7, "max_tokens": 5}
    sp = to_sampling_params(CompletionRequest(prompt="x"), 16, None, defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.top_p) == (0.6, 7, 5, 1.0)
    assert not sp.greedy
    sp = to_sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=3), 2, None, defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0, 3, 2) and sp.greedy
    assert to_sampling_params(CompletionRequest(prompt="x"), None, None).temperature == 1.0  # vLLM's default


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_have_vllm_names(http, tokenizer):
    before = _samples(http.get("/metrics").text)
    prompt = "Paged attention stores keys and values in blocks."
    n_prompt = len(tokenizer.encode(prompt))
    r = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ).json()
    assert r["usage"]["prompt_tokens"] == n_prompt
    text = http.get("/metrics").text
    assert "pagedllm:" not in text
    after = _samples(text)
    label = f'{{model_name="{MODEL}"}}'

    def delta(name: str) -> float:
        return after[name + label] - before.get(name + label, 0.0)

    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:request_prompt_tokens_sum") == n_prompt
    assert delta("vllm:request_prompt_tokens_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 4
    assert delta("vllm:request_params_max_tokens_sum") == 4
    assert delta("vllm:request_params_n_sum") == 1
    assert delta("vllm:iteration_tokens_total_count") >= 4  # prefill + 3 decode steps at least
    assert delta("vllm:iteration_tokens_total_sum") >= n_prompt + 3
    # prometheus-client orders labels its own way: find the series by its labels
    (success,) = [k for k in after if k.startswith("vllm:request_success_total{") and 'finished_reason="length"' in k]
    assert f'model_name="{MODEL}"' in success
    assert after[success] - before.get(success, 0.0) == 1
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert delta(name + "_count") == 1, name
        assert 0 <= delta(name + "_sum") < 60, name
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert gauge + label in after, gauge
    for counter in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert counter + label in after, counter
    (info,) = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert 'block_size="16"' in info and 'num_gpu_blocks="256"' in info and after[info] == 1
