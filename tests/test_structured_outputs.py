"""Structured outputs offline: a random-weight model's outputs match their JSON schema, regex,
choice or grammar, with greedy and random sampling, and constrained greedy output does not change
with batch composition, block size, chunked prefill or preemption.

The tiny model's weights are random: left alone it writes byte soup (the first test proves the
constraint is what makes its outputs valid). Schemas bound every string, number and array so a
valid output also ends within max_tokens.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import GuidedDecodingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 160


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of bounded output: objects of bounded strings, integers, booleans, enums,
    arrays and (once) nested objects."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "string":
            s = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            s = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote', "x"], rng.randint(1, 3))}
        elif kind == "array":
            digit = {"type": "integer", "minimum": 0, "maximum": 9}
            s = {"type": "array", "items": digit, "maxItems": rng.randint(0, 3)}
        else:
            s = random_schema(rng, depth + 1)
        props[f"f{i}_{kind}"] = s
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [random_schema(random.Random(i)) for i in range(20)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=512, block_size=16, seed=0)


def texts(llm: LLM, prompts, params: SamplingParams) -> list[str]:
    return [c.text for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def test_unconstrained_output_is_not_json(llm):
    # Without the constraint the model's text is not JSON: what the tests below check is the mask.
    out = texts(llm, ["def hello"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    with pytest.raises(ValueError):
        json.loads(out[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas(llm, temperature):
    prompts = [f"record {i}:" for i in range(len(SCHEMAS))]
    params = [
        SamplingParams(
            temperature=temperature, seed=i, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=s)
        )
        for i, s in enumerate(SCHEMAS)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, o in zip(SCHEMAS, outs, strict=True):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_and_schema_as_text(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs={"json_object": True})
    # An unbounded object may not end within max_tokens; what was written must still be a JSON prefix.
    (text,) = texts(llm, ["{"], params)
    assert text.startswith("{")
    schema = SCHEMAS[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": json.dumps(schema)})
    (text,) = texts(llm, ["x"], params)
    jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar(llm):
    regex = r"([0-9]{3}-[0-9]{4}|[a-f]{2,5}@x\.org)"  # \\d: Unicode digits, Rust's newer than Python's
    choices = ["yes", "no", "don't know", "é ü"]
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'
    for temperature in (0.0, 1.0):
        for seed in range(4):
            kw = dict(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)
            (r,) = texts(llm, ["call"], SamplingParams(**kw, structured_outputs=StructuredOutputsParams(regex=regex)))
            assert re.fullmatch(regex, r), r
            choice = StructuredOutputsParams(choice=choices)
            (c,) = texts(llm, ["answer"], SamplingParams(**kw, structured_outputs=choice))
            assert c in choices
            (g,) = texts(llm, ["list"], SamplingParams(**kw, structured_outputs=GuidedDecodingParams(grammar=gbnf)))
            # The grammar's language as a regex; max_tokens may cut a long list: then a prefix.
            assert re.fullmatch(r"\((\d|ab)(,(\d|ab))*\)", g) or len(g) > 100, g


def test_n_samples_each_constrained(llm):
    schema = {"json": SCHEMAS[5]}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured_outputs=schema)
    (out,) = llm.generate(["many"], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[5])


def test_bad_constraints_are_refused_and_nothing_queued(llm):
    engine = llm.llm_engine
    bad = [
        {"regex": "a("},
        {"json": "{not json"},
        {"grammar": "root ::= undefined_rule"},
        {"json": {"type": "object"}, "regex": "x"},  # two at once
        {},
    ]
    for spec in bad:
        with pytest.raises(ValueError, match="structured"):
            llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks


def constrained_greedy(model_dir: str, **engine_kwargs) -> list[list[int]]:
    kwargs = dict(dtype="float32", num_kv_blocks=512, block_size=16)
    kwargs.update(engine_kwargs)
    llm = LLM(model=model_dir, **kwargs)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]} for _ in range(8)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS[i]})
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.kv_manager.num_free_blocks() == llm.llm_engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


def test_constrained_greedy_invariance(tiny_llama):
    expected = constrained_greedy(tiny_llama, max_num_seqs=1)
    assert constrained_greedy(tiny_llama, block_size=8) == expected
    assert constrained_greedy(tiny_llama, max_num_batched_tokens=7) == expected
    # A cache too small for every sequence at once: sequences are preempted and recomputed.
    assert constrained_greedy(tiny_llama, block_size=8, num_kv_blocks=30) == expected


@pytest.mark.parametrize("vocab", [31, 32, 100, 49152])
def test_bitmask_kernel_equals_torch_path(vocab):
    """The compiled masking (word at a time) sets exactly the -infs of the unpacked-bit path, on
    masks of all-allowed, all-banned and mixed words, for rows in any order."""
    import numpy as np
    import torch

    from pagedllm.kernels import load_cpu_kernels
    from pagedllm.sampler import AllowedTokens

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("CPU kernels not built here")
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    mask = rng.integers(-(2**31), 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    mask[0] = -1
    mask[1] = 0
    mask[2, ::2] = -1
    logits = torch.randn(7, vocab)
    rows = [4, 0, 6, 1, 2]
    expected = logits.clone()
    AllowedTokens(rows, mask).apply(expected)
    got = logits.clone()
    AllowedTokens(rows, mask).apply(got, kernels.apply_token_bitmask)
    assert torch.equal(got, expected)
    assert not torch.isinf(got[4]).any() and torch.isinf(got[0]).all()  # mask rows 0 / 1: all allowed / banned
    assert torch.equal(got[3], logits[3]) and torch.equal(got[5], logits[5])  # unconstrained rows untouched
    for i, r in enumerate(rows):  # and the torch path against the bits themselves
        allowed = [(int(mask[i, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        assert [not torch.isinf(v).item() for v in got[r]] == [bool(a) for a in allowed]
