"""The config (and tokenizer) of a GGUF-converted folder read without AutoConfig: held equal to
transformers' own for the tiny GGUF test models (llama, qwen2, qwen3) and the default model."""

from __future__ import annotations

import pytest
import torch
from gguf_models import write_gguf

from pagedllm.engine.builder import eos_token_ids, resolve_max_model_len
from pagedllm.models.attention_windows import sliding_window
from pagedllm.models.loader import load_hf_config, resolve_dtype
from pagedllm.models.plain_config import PlainLlamaConfig, read_plain_config
from pagedllm.models.registry import get_model_class
from pagedllm.models.resolve import default_model_gguf_path, resolve_model_path
from pagedllm.models.rope import RotaryEmbedding
from pagedllm.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

_MISSING = object()
# What pagedllm (and AutoTokenizer, given a config) read from a config, aliases included
_READ = (
    "architectures model_type vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads head_dim max_position_embeddings rms_norm_eps rope_parameters rope_scaling rope_theta "
    "hidden_act attention_bias mlp_bias tie_word_embeddings bos_token_id eos_token_id pad_token_id dtype "
    "torch_dtype use_cache sliding_window use_sliding_window layer_types _name_or_path tokenizer_class model_name"
).split()
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  spaces\tand\nnewlines ",
    "def f(x): return 2",
]


@pytest.fixture(scope="module")
def converted_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """Metadata-only conversions (what the native GGUF path loads): tiny untied and tied llamas,
    the Qwen families, and the default model when installed."""
    root = tmp_path_factory.mktemp("plain_config")
    cache = str(root / "cache")
    dirs = {}
    # llama3_rope's GGUF: rope scaling dropped, embeddings tied; qwen2: tied, MQA; qwen3: head_dim
    for fam in ("llama", "llama3_rope", "qwen2", "qwen3"):
        gguf = write_gguf(tiny_model_dirs[fam], str(root / f"{fam}.gguf"), {})
        dirs[fam] = resolve_model_path(gguf, cache_dir=cache, weights=False)
    default = default_model_gguf_path()
    if default is not None:
        dirs["default"] = resolve_model_path(default, cache_dir=cache, weights=False)
    return dirs


def _attrs(cfg, names) -> dict:
    return {n: getattr(cfg, n, _MISSING) for n in names}


def test_plain_config_equals_autoconfig(converted_dirs) -> None:
    for name, d in converted_dirs.items():  # whatever transformers' version: these are ours to read
        assert isinstance(read_plain_config(d), PlainLlamaConfig), name
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("PlainLlamaConfig mirrors transformers 5's LlamaConfig attributes")
    for name, d in converted_dirs.items():
        plain = load_hf_config(d)
        auto = transformers.AutoConfig.from_pretrained(d)
        names = set(_READ) | set(vars(plain))
        assert _attrs(plain, names) == _attrs(auto, names), name


def test_plain_config_gives_the_same_model(converted_dirs) -> None:
    """What pagedllm derives from the config, whatever transformers' version."""
    for name, d in converted_dirs.items():
        plain, auto = load_hf_config(d), transformers.AutoConfig.from_pretrained(d)
        assert get_model_class(plain) is get_model_class(auto), name
        assert resolve_max_model_len(plain, None) == resolve_max_model_len(auto, None), name
        assert sliding_window(plain) == sliding_window(auto), name
        for dtype in ("auto", "float32", "bfloat16"):
            assert resolve_dtype(dtype, plain, torch.device("cpu")) == resolve_dtype(dtype, auto, torch.device("cpu"))
        a, b = RotaryEmbedding(plain, 64), RotaryEmbedding(auto, 64)
        assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin), name
        with torch.device("meta"):
            ma, mb = get_model_class(plain)(plain, 64), get_model_class(auto)(auto, 64)
        assert repr(ma) == repr(mb), name
        assert eos_token_ids(plain, None, d) == eos_token_ids(auto, None, d), name


def test_tokenizer_with_plain_config_equals_autotokenizer(converted_dirs) -> None:
    for name, d in converted_dirs.items():
        ours = load_tokenizer(d, load_hf_config(d))
        ref = transformers.AutoTokenizer.from_pretrained(d)
        assert type(ours) is type(ref), name
        assert ours.get_vocab() == ref.get_vocab(), name
        assert ours.all_special_ids == ref.all_special_ids and ours.eos_token_id == ref.eos_token_id, name
        assert ours.chat_template == ref.chat_template, name
        for text in TEXTS:
            ids = ref.encode(text)
            assert ours.encode(text) == ids, (name, text)
            assert ours.decode(ids) == ref.decode(ids), (name, text)
        if ref.chat_template:
            msgs = [{"role": "user", "content": TEXTS[1]}]
            kw = dict(tokenize=False, add_generation_prompt=True)
            assert ours.apply_chat_template(msgs, **kw) == ref.apply_chat_template(msgs, **kw), name


def test_other_configs_go_to_autoconfig(tiny_model_dirs, tmp_path) -> None:
    # HF checkpoints (keys transformers writes), other families, rope scaling: not read here
    for d in tiny_model_dirs.values():
        assert read_plain_config(d) is None
    assert read_plain_config(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    assert read_plain_config(str(tmp_path)) is None
