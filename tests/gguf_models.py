"""Writes tiny GGUF files (llama.cpp layout) for the GGUF loading and quantized-execution tests.

Weights come from a tiny HF checkpoint (tiny_models.build_model), q/k rows permuted as llama.cpp's
converter does for llama (not for the NEOX-RoPE families), Gemma's norms stored + 1, and quantized
with gguf-py's own quantizers (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0). gguf-py cannot quantize
K-quants, so K-quant tensors get hand-packed blocks: random quant bits and sub-block scales with
small fp16 super-block scales (any bit pattern is a valid block; the tests compare paths, not
against the float checkpoint).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    SpecialVocab,
    get_tensor_name_map,
)
from gguf.quants import quantize

T = GGMLQuantizationType
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)

_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused q/k/v
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused [gate; up], under llama.cpp's up name
}
# model_type -> llama.cpp's general.architecture, whether its converter permutes q/k rows, and the
# tokenizer.ggml.pre it writes for the family's BPE ("qwen2": Qwen's split regex)
ARCHITECTURES = {
    "llama": ("llama", True, "default"),
    "qwen2": ("qwen2", False, "qwen2"),
    "qwen3": ("qwen3", False, "qwen2"),
    "phi3": ("phi3", False, "default"),
    "gpt2": ("gpt2", False, "gpt-2"),
    # a Gemma 3 checkpoint without tokenizer.model: llama.cpp's converter writes its BPE as "gpt2"
    "gemma3_text": ("gemma3", False, "default"),
}
# What llama.cpp's Gemma 3 assumes instead of reading it (see gguf_arch.gemma3_config)
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gguf_name(hf: str) -> str:
    base, _, kind = hf.removeprefix("model.").rpartition(".")
    if base.startswith("layers."):
        _, i, rest = base.split(".", 2)
        return f"blk.{i}.{_NAMES[rest]}.{kind}"
    top = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output", "position_embd": "position_embd"}
    return top[base] + f".{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (the inverse of gguf_arch.unpermute_rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Formats gguf-py dequantizes but cannot quantize: the byte offsets of each block's float16 scales.
# The rest of a block is random (any bytes are valid quants there); the scales are set small so
# that values stay in a sane range.
RANDOM_BLOCK_SCALES = {
    T.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    T.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    T.IQ4_NL: (0,),  # d qs[16]
    T.IQ4_XS: (0,),  # d scales_h scales_l[4] qs[128]
}


def pack_random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks of ``qtype`` (one of RANDOM_BLOCK_SCALES) with small scales."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    for off in RANDOM_BLOCK_SCALES[qtype]:
        d = rng.uniform(2e-3, 5e-3, (rows, k // block)).astype(np.float16)
        raw[..., off : off + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def pack_k_quant(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        v = rng.uniform(lo, hi, (rows, k // block)).astype(np.float16)
        return np.frombuffer(v.tobytes(), np.uint8).reshape(rows, k // block, 2)

    if qtype == T.Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        raw[..., 208:210] = f16(2e-4, 5e-4)
    else:  # d, dmin, 6-bit scales / mins, quants
        raw[..., 0:2] = f16(1e-3, 3e-3)
        raw[..., 2:4] = f16(1e-3, 3e-3)
    return raw.reshape(rows, -1)


def write_gguf(
    hf_dir: str,
    path: str,
    formats: dict[str, GGMLQuantizationType],
    seed: int = 0,
    architecture: str | None = None,
) -> str:
    """Writes hf_dir's model as a GGUF of its family at path. ``formats``: per GGUF tensor kind
    ("attn_q", "ffn_down", "token_embd", "output", ...) its type; unlisted matrices Q8_0, 1-D
    tensors F32. ``architecture``: another general.architecture to write (the keys follow it)."""
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    rng = np.random.default_rng(seed)
    arch, permuted, pre = ARCHITECTURES[cfg["model_type"]]
    w = GGUFWriter(path, architecture or arch)
    name_of = gguf_name
    if cfg["model_type"] == "gpt2":
        tensors = _gpt2_tensors(w, cfg, tensors)
        n_head = n_kv = cfg["n_head"]
    else:
        n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        _add_llama_metadata(w, cfg)
    if cfg["model_type"] == "gemma3_text":
        _add_gemma3_metadata(w, cfg)
        # gguf-py's own name map (llama.cpp's): Gemma's four norms a layer have names of their own
        names = get_tensor_name_map(MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
        name_of = lambda hf: names.get_name(hf, try_suffixes=(".weight", ".bias"))  # noqa: E731
    _add_tokenizer(w, hf_dir, pre)
    for name, t in tensors.items():
        gname = name_of(name)
        a = t.float().numpy()
        if cfg["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp multiplies by the norm weight, Gemma by 1 + weight
        if permuted and ".attn_q." in gname:
            a = permute(a, n_head)
        elif permuted and ".attn_k." in gname:
            a = permute(a, n_kv)
        if a.ndim == 1:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
            continue
        kind = gname.split(".")[-2]
        qtype = formats.get(kind, T.Q8_0)
        if qtype == T.F32:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == T.F16:
            w.add_tensor(gname, a.astype(np.float16))
        elif qtype in K_QUANTS:
            w.add_tensor(gname, pack_k_quant(qtype, a.shape[0], a.shape[1], rng), raw_dtype=qtype)
        elif qtype in RANDOM_BLOCK_SCALES:
            w.add_tensor(gname, pack_random_blocks(qtype, a.shape[0], a.shape[1], rng), raw_dtype=qtype)
        else:
            w.add_tensor(gname, quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_llama_metadata(w: GGUFWriter, cfg: dict) -> None:
    """The Llama-like families' metadata, as llama.cpp's converter writes it."""
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if cfg.get("head_dim"):  # as llama.cpp's converter: only where the config names it
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    # transformers 5 writes rope_theta inside rope_parameters (Gemma 3: per layer type, the file
    # holds the global layers'), 4.x at the top level
    rope = cfg.get("rope_parameters", {})
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["model_type"] == "phi3":
        _add_phi3_rope(w, cfg)


def _add_gemma3_metadata(w: GGUFWriter, cfg: dict) -> None:
    """What llama.cpp's Gemma 3 converter adds to the Llama-like keys: the window and the global
    layers' linear RoPE scaling. A config llama.cpp could not run as HF does is refused: it reads
    no layer pattern, local RoPE base or attention scale from the file."""
    n = cfg["num_hidden_layers"]
    pattern = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention" for i in range(n)]
    rope = cfg["rope_parameters"]
    local, full = rope["sliding_attention"], rope["full_attention"]
    scale = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    refusals = {
        "layer_types": (cfg["layer_types"], pattern),
        "local RoPE": ((local["rope_type"], local["rope_theta"]), ("default", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": (cfg["query_pre_attn_scalar"], scale),
    }
    for what, (have, llama_cpp) in refusals.items():
        if have != llama_cpp:
            raise ValueError(f"llama.cpp's gemma3 cannot express {what} {have!r} (it assumes {llama_cpp!r})")
    w.add_sliding_window(cfg["sliding_window"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full["rope_type"] != "default":
        raise ValueError(f"llama.cpp's gemma3 converter writes linear RoPE scaling only, not {full['rope_type']!r}")


def _gpt2_tensors(w: GGUFWriter, cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's metadata as llama.cpp's converter writes it, and its tensors under Llama-style HF
    names (gguf_name's): Conv1D weights transposed to [out, in], the LM head a copy of wte."""
    w.add_context_length(cfg["n_positions"])
    w.add_embedding_length(cfg["n_embd"])
    w.add_feed_forward_length(cfg.get("n_inner") or 4 * cfg["n_embd"])
    w.add_block_count(cfg["n_layer"])
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("transformer.")
        if name.startswith("h."):
            _, i, rest = name.split(".", 2)
            base, _, kind = rest.rpartition(".")
            if base in _GPT2_CONV1D and kind == "weight":
                t = t.t()
            out[f"layers.{i}.{_GPT2_NAMES[base]}.{kind}"] = t
        elif not name.startswith("lm_head."):
            out[_GPT2_TOP[name.partition(".")[0]] + "." + name.partition(".")[2]] = t
    out["lm_head.weight"] = tensors["transformer.wte.weight"]
    return out


_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# GPT-2 name -> the HF name gguf_name maps to llama.cpp's (c_fc: ffn_up, c_proj: ffn_down)
_GPT2_NAMES = {
    "ln_1": "input_layernorm",
    "attn.c_attn": "self_attn.qkv_proj",
    "attn.c_proj": "self_attn.o_proj",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
_GPT2_TOP = {"wte": "embed_tokens", "wpe": "position_embd", "ln_f": "norm"}


def _add_phi3_rope(w: GGUFWriter, cfg: dict) -> None:
    """What llama.cpp's Phi-3 converter writes of its RoPE: the rotary dims, the sliding window
    (0: none), and for LongRoPE the original context, the attention factor it derives from the two
    lengths and the factors as the tensors rope_factors_short / _long."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") != "longrope":
        return
    orig = cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    scale = cfg["max_position_embeddings"] / orig
    w.add_rope_scaling_attn_factors(1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig)))
    for kind in ("long", "short"):
        w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))


def _add_tokenizer(w: GGUFWriter, hf_dir: str, pre: str) -> None:
    """The tiny byte-level BPE tokenizer as llama.cpp's "gpt2" vocab (what transformers reads back),
    with its special tokens and chat template."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    special = {a["id"] for a in tok.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    # special token ids (config.json's pad), whether a BOS is added (Gemma's post-processor) and
    # the chat template, as llama.cpp's converter takes them: through gguf-py's SpecialVocab
    SpecialVocab(hf_dir, load_merges=False).add_to_gguf(w, quiet=True)


def tiny_kquant_hf(out_dir: str) -> str:
    """A tiny llama whose every matrix has K a multiple of 256 (the K-quant super-block)."""
    from tiny_models import VOCAB, build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


@contextmanager
def gguf_files_with_cache(root, files: dict[str, tuple[str, dict]]) -> Iterator[dict[str, str]]:
    """Writes ``files`` (name -> (HF folder, formats)) as root/NAME.gguf; yields their paths with
    PAGEDLLM_CACHE_DIR under root (the folders loading writes stay in the test's tmp dir)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root / "cache"))
        yield {name: write_gguf(hf, str(root / f"{name}.gguf"), formats) for name, (hf, formats) in files.items()}


# The tiny Gemma 3 as llama.cpp can express it (tiny_models' own has a layer pattern and attention
# scale of its own, for the HF tests): every 6th layer global, 1/sqrt(head_dim); GQA, the window
# narrower than long prompts and the linear-scaled global RoPE stay.
GEMMA3_AS_LLAMA_CPP = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "query_pre_attn_scalar": 32,  # its head_dim
}


def tiny_gemma3_llama_cpp_hf(out_dir: str) -> str:
    from tiny_models import build_model

    return build_model("gemma3", out_dir, config_overrides=GEMMA3_AS_LLAMA_CPP)
