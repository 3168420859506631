"""The tensors of a GGUF file as views of its memory map, without parsing its metadata.

gguf-py's GGUFReader turns every metadata array element into numpy views of its own: for a
49k-token vocabulary with its merges that is ~500k objects, ~150 MB of Python heap while loading
(which then fragments the heap the weights are copied into), and for Gemma 3's 262k tokens ~15 s
on a small machine. Loading the weights needs only the tensor index, so this reads the header,
steps over the metadata values (keeping only general.alignment and general.architecture) and
gives each tensor what GGUFReader's ReaderTensor has for it: name, type, ggml-order shape and the
same data view. Asked for, it decodes the metadata too, into the plain values GGUFReader's
``contents()`` gives (~0.5 s for that vocabulary). tests/test_gguf_tensors.py holds both equal to
GGUFReader.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType): byte sizes of the fixed-size ones
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_SIZES = {vtype: struct.calcsize(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}
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
    metadata: dict[str, Any] | None = None  # key -> value (arrays as lists), where asked for


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        # slices of a memoryview are cheap; of the memmap, each is a new memmap object
        self.buf, self.pos = memoryview(buf), 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> bytes:
        (n,) = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
        if vtype in _SCALAR_FORMATS:
            return self.take("<" + _SCALAR_FORMATS[vtype])[0]
        if vtype == _STRING:
            return self.string().decode("utf-8")
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        itype, count = self.take("<IQ")
        if itype in _SCALAR_FORMATS:  # numbers in one go (a vocabulary's scores and token types)
            return list(self.take(f"<{count}{_SCALAR_FORMATS[itype]}"))
        return [self.value(itype) for _ in range(count)]

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


def read_gguf_index(path: str, metadata: bool = False) -> GGUFIndex | None:
    """``path``'s architecture and tensors, and with ``metadata`` every metadata value (see
    read_gguf_tensors; None as there)."""
    buf = np.memmap(path, mode="r")
    cur = _Cursor(buf)
    magic, version = cur.take("<II")
    if magic != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    if sys.byteorder != "little" or version not in _VERSIONS:
        return None
    n_tensors, n_kv = cur.take("<QQ")
    alignment, architecture = _DEFAULT_ALIGNMENT, None
    values: dict[str, Any] | None = {} if metadata else None
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("<I")
        if key == b"general.alignment":
            if vtype != _UINT32:
                raise ValueError("Bad type for general.alignment field")
            (alignment,) = cur.take("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
            value: Any = alignment
        elif key == _ARCHITECTURE and vtype == _STRING:
            value = architecture = cur.string().decode("utf-8")
        elif values is not None:
            value = cur.value(vtype)
        else:
            cur.skip_value(vtype)
            continue
        if values is not None:
            values[key.decode("utf-8")] = value
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
    return GGUFIndex(architecture, tensors, values)
