"""Convert a GGUF file (llama.cpp format) into a Hugging Face model folder.

The file's family (``general.architecture``) is looked up in models/gguf_arch.py, which says what
its config values, tensor names and q/k row order are in HF terms.

The rest of pagedllm only knows how to load HF-format folders (config.json + model.safetensors +
tokenizer files). GGUF checkpoints are therefore converted once, dequantized to float32, and cached
(see ``pagedllm.models.resolve``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from pagedllm.models.gguf_arch import GGUFArchitecture, gguf_architecture
from pagedllm.models.gguf_tensors import GGUFIndex, read_gguf_index

logger = logging.getLogger(__name__)

# Bump when the output format changes, so cached conversions get redone (used in resolve's cache key).
CONVERTER_VERSION = 3


def _read_gguf(gguf_path: str) -> GGUFIndex:
    """The file's tensors and metadata; gguf-py's GGUFReader only for what gguf_tensors leaves to
    it (it takes ~15 s over a 262k-token vocabulary: gguf_tensors' docstring)."""
    index = read_gguf_index(gguf_path, metadata=True)
    if index is None:
        reader = GGUFReader(gguf_path)
        fields = {k: f.contents() for k, f in reader.fields.items()}
        index = GGUFIndex(fields.get("general.architecture"), reader.tensors, fields)
    return index


def _meta(gguf_file: GGUFIndex, key: str, default: Any = None) -> Any:
    """Value of a GGUF metadata key as a plain Python value (str / int / float / list)."""
    return gguf_file.metadata.get(key, default)


def _f32_to_float(x: float) -> float:
    # GGUF stores floats as float32, so 1e-5 reads back as 9.999999747e-06. Round-trip through the
    # shortest float32 repr to get the value the original config.json had.
    return float(str(np.float32(x)))


# Config values llama.cpp itself assumes when a file leaves their metadata key out.
_FALLBACKS = {
    "num_key_value_heads": lambda c: c["num_attention_heads"],
    "head_dim": lambda c: c["hidden_size"] // c["num_attention_heads"],
    "rope_theta": lambda c: 10000.0,
}
# Keys whose absence means the feature is off: left out of config.json (the HF config's default).
_OPTIONAL = frozenset({"sliding_window", "final_logit_softcapping"})


def _metadata_config(gguf_file: GGUFIndex, gguf_arch: str, arch: GGUFArchitecture) -> dict[str, Any]:
    """The config values ``arch.metadata`` names, read from the file's "{gguf_arch}." keys."""
    values: dict[str, Any] = {}
    for hf_key, gguf_key in arch.metadata.items():
        v = _meta(gguf_file, f"{gguf_arch}.{gguf_key}")
        if v is None:
            if hf_key in _FALLBACKS:
                v = _FALLBACKS[hf_key](values)
            elif hf_key in _OPTIONAL:
                continue
            else:
                raise ValueError(f"GGUF metadata key {gguf_arch}.{gguf_key} is missing")
        values[hf_key] = _f32_to_float(v) if isinstance(v, float) else int(v)
    return values


def _longrope_scaling(gguf_file: GGUFIndex, gguf_arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """HF's longrope rope_scaling from what llama.cpp's Phi-3 converter wrote: the factors as the
    tensors rope_factors_short / _long, the original context in metadata."""
    factors = {t.name: t for t in gguf_file.tensors if t.name.startswith("rope_factors_")}
    orig = _meta(gguf_file, f"{gguf_arch}.rope.scaling.original_context_length")
    if orig is None or set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ValueError("GGUF LongRoPE needs rope_factors_long, rope_factors_short and the original context length")
    scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig)}
    for kind in ("short", "long"):
        t = factors[f"rope_factors_{kind}.weight"]
        scaling[f"{kind}_factor"] = dequantize(t.data, t.tensor_type).astype(np.float32).ravel().tolist()
    # HF derives the attention factor from the two context lengths, as llama.cpp's converter did
    # when it wrote it; a file whose factor differs (a fine-tune's own) keeps it explicitly
    attn = _meta(gguf_file, f"{gguf_arch}.rope.scaling.attn_factor")
    ratio = values["max_position_embeddings"] / int(orig)
    derived = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(int(orig)))
    if attn is not None and not math.isclose(attn, derived, rel_tol=1e-6):
        scaling["attention_factor"] = _f32_to_float(attn)
    values["original_max_position_embeddings"] = int(orig)
    return scaling


def _build_config(gguf_file: GGUFIndex, gguf_arch: str, tensor_names: set[str]) -> dict[str, Any]:
    def m(key: str, default: Any = None) -> Any:
        return _meta(gguf_file, f"{gguf_arch}.{key}", default)

    arch = gguf_architecture(gguf_arch)
    values = _metadata_config(gguf_file, gguf_arch, arch)
    vocab_size = m("vocab_size")
    if vocab_size is None:  # older GGUFs: vocab size is implied by the token list
        vocab_size = len(_meta(gguf_file, "tokenizer.ggml.tokens"))
    special = {
        "bos_token_id": _meta(gguf_file, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(gguf_file, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(gguf_file, "tokenizer.ggml.padding_token_id"),
    }
    if not arch.llama_like:
        return _gpt2_config(gguf_file, arch, int(vocab_size), values, special, tensor_names)

    rope_scaling = None
    scaling_type = m("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(m("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        rope_scaling = {
            "rope_type": "yarn",
            "factor": float(m("rope.scaling.factor")),
            "original_max_position_embeddings": int(m("rope.scaling.original_context_length")),
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"Unsupported GGUF rope scaling type {scaling_type!r}")
    if "rope_factors_long.weight" in tensor_names:
        rope_scaling = _longrope_scaling(gguf_file, gguf_arch, values)
    rope_dims = m("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != values["head_dim"]:  # Phi-4-mini: RoPE on part of a head
        values["partial_rotary_factor"] = int(rope_dims) / values["head_dim"]
        if rope_scaling is not None:
            rope_scaling["partial_rotary_factor"] = values["partial_rotary_factor"]
    if values.get("sliding_window") == 0:  # llama.cpp's converter writes 0 for "no window"
        del values["sliding_window"]
    if "rope_freqs.weight" in tensor_names:
        # Llama-3.1 style scaling is stored by llama.cpp as precomputed frequencies; mapping it back
        # to HF's llama3 rope parameters is not implemented, and ignoring it would silently give a
        # different model.
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")

    # Legacy-style keys (rope_theta / rope_scaling / torch_dtype), as in the original Hub
    # config.json: understood by transformers 4.x and 5.x and easy for our own code to read.
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": int(vocab_size),
        **values,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        # HF's attention_bias means q/k/v *and* o_proj have biases (Llama, Qwen3). Qwen2's q/k/v
        # biases come with its model class and its o_proj has none: so the output bias decides.
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
        **arch.config,
        # llama.cpp omits output.weight when lm_head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **special,
        # The dequantized weights are float32 values, so that is the model's own dtype and what
        # dtype="auto" runs: rounding them to bf16 flips near-ties of a small model's logits (the
        # default model then misses "Paris"). --dtype bfloat16 trades that for speed.
        "torch_dtype": "float32",
        "use_cache": True,
    }
    return config if arch.derive_config is None else arch.derive_config(config)


def _gpt2_config(
    gguf_file: GGUFIndex,
    arch: GGUFArchitecture,
    vocab_size: int,
    values: dict[str, Any],
    special: dict[str, Any],
    tensor_names: set[str],
) -> dict[str, Any]:
    """GPT-2's config.json. llama.cpp's converter writes the LM head as a copy of the embedding:
    the head is tied where the two hold the same values."""
    if values["n_inner"] == 4 * values["n_embd"]:  # GPT-2's own default, which its configs leave None
        values["n_inner"] = None
    by_name = {t.name: t for t in gguf_file.tensors}
    head, emb = by_name.get("output.weight"), by_name["token_embd.weight"]
    tied = head is None or (head.tensor_type == emb.tensor_type and np.array_equal(head.data, emb.data))
    return {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        **values,
        **arch.config,
        "tie_word_embeddings": tied,
        **special,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _convert_weights(gguf_file: GGUFIndex, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    arch = gguf_architecture(_meta(gguf_file, "general.architecture"))
    n_head = config.get("num_attention_heads")
    n_kv = config.get("num_key_value_heads")
    tensors: dict[str, torch.Tensor] = {}
    for t in gguf_file.tensors:
        if t.name in arch.config_tensors:  # read into config.json already
            continue
        if t.name == "output.weight" and config["tie_word_embeddings"]:  # a copy of token_embd
            continue
        # dequantize() returns numpy in torch order ([out, in]); GGUF's t.shape is ggml order
        # ([in, out]), hence the reversed reshape (a no-op safety net for already-shaped data).
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        # F32 tensors come back as read-only views of the memory-mapped file; torch wants writable.
        if arch.value_shift(t.name):  # Gemma's norms, stored + 1
            w = w - np.float32(arch.value_shift(t.name))
        w = arch.to_hf_layout(t.name, arch.to_hf_rows(t.name, w, n_head, n_kv))
        w = np.require(w, np.float32, ["C", "W"])
        tensors[arch.hf_name(t.name)] = torch.from_numpy(w)
    return tensors


def _save_tokenizer(gguf_path: str, out_dir: str, chat_template: str | None) -> None:
    # transformers has its own GGUF vocab/merges -> tokenizer.json conversion; reuse it rather than
    # re-implementing BPE/SentencePiece reconstruction.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), local_files_only=True
    )
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)

    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok_cfg.pop("local_files_only", None)  # our load-time flag, not a tokenizer property
    # Recent transformers save the template only as chat_template.jinja; also put it in
    # tokenizer_config.json so older transformers and our own jinja rendering find it.
    if chat_template:
        tok_cfg.setdefault("chat_template", chat_template)
    _write_json(cfg_path, tok_cfg)


# What a conversion writes besides its tokenizer files
_NOT_TOKENIZER = frozenset({"config.json", "generation_config.json", "model.safetensors"})


def _copy_tokenizer(src: str, out_dir: str) -> None:
    """The tokenizer files of another finished conversion of the same file: transformers' GGUF
    tokenizer conversion takes ~30 s over Gemma 3's 262k-token vocabulary on a small machine."""
    for name in os.listdir(src):
        if name not in _NOT_TOKENIZER:
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))


def _make_readable(folder: str) -> None:
    # mkdtemp creates the folder 0700 (and safetensors writes 0600); give the cache entry the usual
    # permissions of a downloaded model. (Not umask-based: reading the umask is not thread-safe.)
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_gguf_to_hf(gguf_path: str, out_dir: str, weights: bool = True, tokenizer_from: str | None = None) -> None:
    """Convert ``gguf_path`` into an HF folder at ``out_dir`` (the architecture gguf_arch names).

    Writes config.json, generation_config.json, model.safetensors (float32; only if ``weights``:
    the native quantized path reads the weights from the GGUF itself) and tokenizer files (copied
    from ``tokenizer_from``, a finished conversion of the same file, where given).
    The folder appears atomically: everything is written to a temp dir next to ``out_dir`` and
    renamed at the end, so a crash never leaves a half-written cache entry. If ``out_dir`` already
    holds a finished conversion (e.g. a concurrent process won the race), it is kept.
    """
    gguf_path = os.path.abspath(gguf_path)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)

    gguf_file = _read_gguf(gguf_path)
    arch = _meta(gguf_file, "general.architecture")
    gguf_architecture(arch, gguf_path)  # an unsupported family fails here, before any work
    tensor_names = {t.name for t in gguf_file.tensors}
    config = _build_config(gguf_file, arch, tensor_names)
    chat_template = _meta(gguf_file, "tokenizer.chat_template")

    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        if weights:
            logger.info("Converting GGUF %s -> %s (one-time, dequantizing to float32)", gguf_path, out_dir)
            save_file(
                _convert_weights(gguf_file, config),
                os.path.join(tmp, "model.safetensors"),
                metadata={"format": "pt"},
            )
        _write_json(os.path.join(tmp, "config.json"), config)
        gen_cfg = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(os.path.join(tmp, "generation_config.json"), gen_cfg)
        if tokenizer_from is not None:
            _copy_tokenizer(tokenizer_from, tmp)
        else:
            _save_tokenizer(gguf_path, tmp, chat_template)
        _make_readable(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # out_dir exists: fine if it is a complete conversion (another process finished first).
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
