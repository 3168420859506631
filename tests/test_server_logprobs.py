"""The server's logprobs against Hugging Face transformers, and its sampling controls.

The server splits prompts into 16-token chunks (--max-num-batched-tokens 16) and caches prefixes,
so echo / prompt_logprobs are checked across chunk boundaries and beside cached prefixes; the
values must be HF's log-softmax of the prompt (float32, 1e-4 as tests/test_prompt_logprobs.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_prompt_logprobs import TOL, hf_logprobs, make_prompts
from test_server import ServerProcess

MODEL = "tiny"
MAX_LOGPROBS = 600  # above the tiny vocabulary (512): -1 is allowed


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("logprobs") / "server.log"),
        "--served-model-name",
        MODEL,
        "--max-num-batched-tokens",
        "16",
        "--block-size",
        "8",
        "--max-logprobs",
        str(MAX_LOGPROBS),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def prompts():
    """Two prompts sharing a 48-token prefix (6 blocks: the second finds it cached), and one alone."""
    (prefix,) = make_prompts((48,), seed=21)
    a, b, c = make_prompts((9, 14, 37), seed=22)
    return [prefix + a, prefix + b, c]


@pytest.fixture(scope="module")
def refs(tiny_llama, prompts):
    return hf_logprobs(tiny_llama, prompts)


def check_echo(lp: dict, prompt: list[int], ref, k: int, tokenizer) -> None:
    """OpenAI's legacy shape for the echoed prompt: tokens, token_logprobs (None first),
    top_logprobs (None first, then the top k), text_offset; values HF's."""
    n = len(prompt)
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    offsets = [0]
    for t in prompt[:-1]:
        offsets.append(offsets[-1] + len(tokenizer.decode([t])))
    assert lp["text_offset"][:n] == offsets
    for j in range(1, n):
        row = ref[j - 1]
        assert abs(lp["token_logprobs"][j] - row[prompt[j]].item()) < TOL, j
        top = row.topk(k)
        want = {tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        got = lp["top_logprobs"][j]
        assert got.keys() == want.keys(), j
        assert all(abs(got[s] - want[s]) < TOL for s in want)


def test_echo_logprobs_max_tokens_0_scores_the_prompt_alone(http, prompts, refs, tokenizer):
    """lm-eval's loglikelihood over token-id prompts; max_tokens 0 (vLLM): nothing generated."""
    for _ in range(2):  # the second round finds every prefix cached
        r = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 2}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
        for choice, p, ref in zip(body["choices"], prompts, refs, strict=True):
            assert choice["text"] == tokenizer.decode(p)
            assert choice["finish_reason"] == "length"
            assert len(choice["logprobs"]["tokens"]) == len(p)
            check_echo(choice["logprobs"], p, ref, 2, tokenizer)


def test_echo_logprobs_lm_eval_request(http, prompts, refs, tokenizer):
    """What lm-eval's local-completions sends for loglikelihood: max_tokens 1, logprobs 1, echo,
    temperature 0; it reads token_logprobs / top_logprobs of the prompt's positions."""
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "seed": 1234,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice, p, ref in zip(r.json()["choices"], prompts, refs, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(p) + 1
        check_echo(lp, p, ref, 1, tokenizer)
        # the one generated token: greedy, so HF's argmax after the prompt
        assert lp["token_logprobs"][-1] == pytest.approx(max(lp["top_logprobs"][-1].values()), abs=1e-6)


def test_echo_streamed_equals_unstreamed(http, prompts, refs, tokenizer):
    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens, values = [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp:
                    tokens += lp["tokens"]
                    values += lp["token_logprobs"]
    assert tokens == whole["logprobs"]["tokens"] and values == whole["logprobs"]["token_logprobs"]
    check_echo(whole["logprobs"], prompts[1], refs[1], 2, tokenizer)


def check_vllm_prompt_logprobs(plp: list, prompt: list[int], ref, k: int, tokenizer) -> None:
    """vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}}: the prompt
    token (its own rank) and the top k (ranks 1..k)."""
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        row, d = ref[j - 1], plp[j]
        top = row.topk(k).indices.tolist()
        assert set(d) == {str(t) for t in [*top, prompt[j]]}, j
        for t, e in d.items():
            assert set(e) == {"logprob", "rank", "decoded_token"}
            assert abs(e["logprob"] - row[int(t)].item()) < TOL
            assert e["decoded_token"] == tokenizer.decode([int(t)])
            lo = int((row > row[int(t)] + TOL).sum()) + 1
            hi = int((row > row[int(t)] - TOL).sum()) + 1
            assert lo <= e["rank"] <= hi, (j, t, e["rank"])


def test_prompt_logprobs_completions_and_minus_one(client, prompts, refs, tokenizer):
    out = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    check_vllm_prompt_logprobs(out.choices[0].model_extra["prompt_logprobs"], prompts[0], refs[0], 3, tokenizer)
    # -1: every token of the vocabulary (the cap allows it here)
    out = client.completions.create(
        model=MODEL, prompt=prompts[2][:6], max_tokens=1, extra_body={"prompt_logprobs": -1}
    )
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert all(len(d) == 512 for d in plp[1:])


def test_prompt_logprobs_once_per_prompt(client, prompts):
    """The n choices of a prompt share it: its prompt_logprobs come once, on its first choice
    (index i * n), the others' are null; streamed, on that choice's first chunk."""
    kw = dict(model=MODEL, prompt=[prompts[0][:10], prompts[2][:7]], n=3, max_tokens=2, temperature=0)
    out = client.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    plps = [c.model_extra["prompt_logprobs"] for c in out.choices]
    assert [p is not None for p in plps] == [True, False, False, True, False, False]
    assert len(plps[0]) == 10 and len(plps[3]) == 7
    first: dict[int, list | None] = {}
    for chunk in client.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 1}):
        for c in chunk.choices:
            first.setdefault(c.index, c.model_extra.get("prompt_logprobs"))
    # the same logprobs, up to float rounding: the server's prefix cache, warm from earlier tests,
    # can split the second run's prefill differently (exact equality failed in the full suite only)
    assert sorted(first) == list(range(6))
    for i, plp in enumerate(plps):
        got = first[i]
        assert (got is None) == (plp is None), i
        if plp is not None:
            assert len(got) == len(plp) and got[0] is None and plp[0] is None
            for a, b in zip(got[1:], plp[1:], strict=True):
                assert set(a) == set(b)
                for t in a:
                    assert abs(a[t]["logprob"] - b[t]["logprob"]) < TOL
                    assert a[t]["decoded_token"] == b[t]["decoded_token"]


def test_prompt_response_budget_names_the_costliest_field(http):
    """What a response repeats of its prompts is estimated before it runs: over 4 MiB is a 400
    naming the field (echo's logprobs in each of n choices, or prompt_logprobs of every token)."""
    ids = list(range(3, 403))
    echo = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0}
    r = http.post("/v1/completions", json={**echo, "n": 64})  # 64 x 400 positions x 6 entries: ~6 MiB
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert http.post("/v1/completions", json={**echo, "n": 2}).status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    messages = [{"role": "user", "content": "fox " * 300}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "prompt_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_chat_prompt_logprobs_on_the_response(http, refs, tokenizer, tiny_llama):
    messages = [{"role": "user", "content": "Name a block table."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    (ref,) = hf_logprobs(tiny_llama, [ids])
    r = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    )
    assert r.status_code == 200, r.text
    check_vllm_prompt_logprobs(r.json()["prompt_logprobs"], ids, ref, 1, tokenizer)


def test_chat_logprobs_openai_shape_and_values(client, tokenizer, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    messages = [{"role": "user", "content": "Paged attention"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert set(e.model_dump()) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        for t in e.top_logprobs:
            assert set(t.model_dump()) == {"token", "logprob", "bytes"} and t.bytes == list(t.token.encode("utf-8"))
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top token
    # the first token's top 3 against HF's next-token distribution after the rendered prompt
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        row = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = row.topk(3)
    assert [t.token for t in content[0].top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    for t, v in zip(content[0].top_logprobs, top.values.tolist(), strict=True):
        assert abs(t.logprob - v) < TOL
    streamed = [
        e.model_dump()
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.model_dump() for e in content]


def test_sampling_controls_on_the_server(client, http, tokenizer):
    base = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (world,) = tokenizer.encode(" world", add_special_tokens=False)
    r = http.post("/v1/completions", json={**base, "logit_bias": {str(world): 100}})
    assert r.json()["choices"][0]["text"] == " world" * 6
    r = http.post("/v1/completions", json={**base, "temperature": 1.0, "seed": 3, "allowed_token_ids": [300, 301]})
    assert set(tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False)) <= {300, 301}
    plain = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    r = http.post("/v1/completions", json={**base, "bad_words": [tokenizer.decode([first])]})
    assert r.status_code == 200 and not r.json()["choices"][0]["text"].startswith(tokenizer.decode([first]))
    # truncate_prompt_tokens: the last k tokens run, and that is what echo shows and usage counts
    ids = list(range(30, 70))
    r = http.post(
        "/v1/completions",
        json={**base, "prompt": ids, "echo": True, "max_tokens": 1, "truncate_prompt_tokens": 7},
    ).json()
    assert r["usage"]["prompt_tokens"] == 7 and r["choices"][0]["text"].startswith(tokenizer.decode(ids[-7:]))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a b c d e f g h"}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/chat/completions", {"allowed_token_ids": [1, 512]}, "allowed_token_ids"),
        ("/v1/completions", {"bad_words": [" "]}, "bad_words"),
        ("/v1/completions", {"bad_words": ["x"] * 65}, "bad_words"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # only echo may generate nothing
    ],
)
def test_bad_controls_are_400s_naming_the_field(http, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
