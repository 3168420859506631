"""The config.json that GGUF conversion writes, read without transformers' config classes.

``AutoConfig`` imports ``LlamaConfig``, whose module pulls in transformers' activations, kernel hub
and tensor-parallel code, and through them torch.distributed and sympy: ~55 MB of resident memory
for a dozen numbers. The folders loader_gguf writes hold a fixed set of keys, so for those the
values ``LlamaConfig`` (``Qwen2Config``, ``Qwen3Config`` for those families) would hold are built
here directly; any other config.json (an HF checkpoint, another family, rope scaling, a sliding
window, keys this module does not know) returns None and goes to ``AutoConfig``.
tests/test_plain_config.py holds the result equal to ``AutoConfig``'s attribute by attribute.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# What loader_gguf._build_config writes; a config.json with any other key is not ours.
_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "use_cache",
        "use_sliding_window",
    }
)
# model_type -> (its architectures entry, what its HF config class adds to the file's values for
# a model without a sliding window: every layer full attention)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"sliding_window": None, "max_window_layers": 28}),
    "qwen3": ("Qwen3ForCausalLM", {"sliding_window": None, "max_window_layers": 28}),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlainLlamaConfig:
    """The attributes transformers' config class of the family (``LlamaConfig``, ``Qwen2Config``,
    ``Qwen3Config``) has for a config.json of loader_gguf's keys: the file's values, RoPE as
    ``rope_parameters`` (``rope_scaling`` its alias), the dtype as a torch dtype (``torch_dtype``
    its alias), ``_name_or_path`` (AutoTokenizer reads it) and the family's own additions."""

    model_type = "llama"

    def __init__(self, values: dict[str, Any], name_or_path: str) -> None:
        values = dict(values)
        theta = values.pop("rope_theta", 10000.0)
        values.pop("rope_scaling", None)
        dtype = values.pop("torch_dtype")
        _, additions = _FAMILIES[values["model_type"]]
        self.__dict__.update(additions)
        if additions:  # the Qwen configs name each layer's attention
            self.layer_types = ["full_attention"] * values["num_hidden_layers"]
        self.__dict__.update(values)
        self.rope_parameters = {"rope_theta": theta, "rope_type": "default"}
        self.dtype = _DTYPES[dtype]
        self._name_or_path = name_or_path

    @property
    def rope_scaling(self) -> dict[str, Any]:
        return self.rope_parameters

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype

    def __repr__(self) -> str:
        return f"PlainLlamaConfig({self._name_or_path!r})"


def read_plain_config(model_dir: str) -> PlainLlamaConfig | None:
    """``model_dir``'s config when it is one loader_gguf wrote (a family of ``_FAMILIES``, no rope
    scaling, no sliding window), else None."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(values, dict)
        or not set(values) <= _KEYS
        or not isinstance(values.get("model_type"), str)
        or values["model_type"] not in _FAMILIES
        or values.get("architectures") != [_FAMILIES[values["model_type"]][0]]
        or values.get("use_sliding_window", False) is not False
        or values.get("rope_scaling") is not None
        or values.get("torch_dtype") not in _DTYPES
        or not all(
            isinstance(values.get(k), int)
            for k in ("hidden_size", "num_attention_heads", "head_dim", "num_hidden_layers")
        )
        or not isinstance(values.get("num_key_value_heads"), int)
        or values["hidden_size"] % values["num_attention_heads"]  # LlamaConfig refuses these: let it say why
    ):
        return None
    return PlainLlamaConfig(values, model_dir)
