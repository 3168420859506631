"""The tensors of a GGUF file as views of its memory map, without parsing its metadata.

gguf-py's GGUFReader turns every metadata array element into numpy views of its own: for a
49k-token vocabulary with its merges that is ~500k objects, ~150 MB of Python heap while loading
(which then fragments the heap the weights are copied into). Loading the weights needs only the
tensor index, so this reads the header, steps over the metadata values (keeping only
general.alignment and general.architecture) and gives each tensor what GGUFReader's ReaderTensor has for it: name, type,
ggml-order shape and the same data view. tests/test_gguf_tensors.py holds it equal to GGUFReader.
"""

from __future__ import annotations

import struct
import sys
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType): byte sizes of the fixed-size ones
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_ARCHITECTURE = b"general.architecture"
# Element types of tensors stored as plain numbers (the rest are blocks, viewed as bytes)
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order (innermost first), as GGUFReader's
    data: np.ndarray  # read-only view of the file: numbers, or [..., row bytes] uint8 for blocks


class GGUFIndex(NamedTuple):
    architecture: str | None  # general.architecture, None where the file has none
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> bytes:
        (n,) = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            (n,) = self.take("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            itype, count = self.take("<IQ")
            if itype in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[itype] * count
            else:
                for _ in range(count):
                    self.skip_value(itype)
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_tensors(path: str) -> list[GGUFTensor] | None:
    """``path``'s tensors in file order, or None for a file this reader leaves to GGUFReader (a
    byte order other than this machine's little-endian one, or another GGUF version)."""
    index = read_gguf_index(path)
    return None if index is None else index.tensors


def read_gguf_index(path: str) -> GGUFIndex | None:
    """``path``'s architecture and tensors (see read_gguf_tensors; None as there)."""
    buf = np.memmap(path, mode="r")
    cur = _Cursor(buf)
    magic, version = cur.take("<II")
    if magic != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    if sys.byteorder != "little" or version not in _VERSIONS:
        return None
    n_tensors, n_kv = cur.take("<QQ")
    alignment, architecture = _DEFAULT_ALIGNMENT, None
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("<I")
        if key == b"general.alignment":
            if vtype != _UINT32:
                raise ValueError("Bad type for general.alignment field")
            (alignment,) = cur.take("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        elif key == _ARCHITECTURE and vtype == _STRING:
            architecture = cur.string().decode("utf-8")
        else:
            cur.skip_value(vtype)
    index = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8")
        (n_dims,) = cur.take("<I")
        dims = cur.take(f"<{n_dims}Q")
        qtype, offset = cur.take("<IQ")
        index.append((name, dims, GGMLQuantizationType(qtype), offset))
    start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, qtype, offset in index:
        if name in seen:
            raise ValueError(f"Found duplicated tensor with name {name}")
        seen.add(name)
        n_elems = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        pos = start + offset
        if qtype in _PLAIN:
            dtype = np.dtype(_PLAIN[qtype])
            data = buf[pos : pos + n_elems * dtype.itemsize].view(dtype)[:n_elems].reshape(np_dims)
        else:
            block, nbytes = GGML_QUANT_SIZES[qtype]
            size = n_elems * nbytes // block
            data = buf[pos : pos + size].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        tensors.append(GGUFTensor(name, qtype, tuple(dims), data))
    return GGUFIndex(architecture, tensors)
