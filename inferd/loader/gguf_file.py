"""A GGUF file's key/value metadata and its tensor directory, read with `struct` over a map of the
file; the tensors' data are numpy views of the map (nothing is copied).

`gguf.GGUFReader` builds numpy views for every element of every array field: ~13 s for Gemma 3's
262k-token vocabulary on a fast core, half a minute on a slow one, before a tensor is read. Here
an array of numbers is one `frombuffer` and a string one slice. gguf-py still owns the formats:
its quantization types, block sizes and dequantizers are used as they are.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, key/value count
u64; per pair a string key, a u32 type and the value (strings: a u64 length and UTF-8 bytes);
per tensor a string name, a u32 dimension count, u64 dimensions (fastest first), a u32 type and a
u64 offset; then the data, from the first multiple of `general.alignment` (32 by default), each
tensor at its offset from there.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class GGUFMetadataError(ValueError):
    pass


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise GGUFMetadataError("the metadata runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise GGUFMetadataError("a string runs past the end of the file")
        text = self.data[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind != _ARRAY:
            raise GGUFMetadataError(f"unknown GGUF value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            end = self.pos + count * dtype.itemsize
            if end > len(self.data):
                raise GGUFMetadataError("an array runs past the end of the file")
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        if count * 8 > len(self.data) - self.pos:  # every item takes 8 bytes at least
            raise GGUFMetadataError("an array runs past the end of the file")
        return [self.value(item) for _ in range(count)]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `shape` in ggml's order (fastest first); `data` a read-only view of
    the map, shaped as gguf-py's reader shapes it (float and integer types in their dtype,
    slowest dimension first; quantized types as bytes, `quant_shape_to_byte_shape`)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    data_offset: int  # where the tensors' data start


def _header(f: Any, path: Path) -> tuple[int, int]:
    """(tensor count, key/value count) from the 24-byte header."""
    head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise GGUFMetadataError(f"{path}: not a GGUF file")
    version, tensors, pairs = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3):
        if version & 0xFFFF == 0:  # a version 2 or 3 written the other way round
            raise GGUFMetadataError(f"{path}: a big-endian GGUF file (inferd reads little-endian)")
        raise GGUFMetadataError(f"{path}: GGUF version {version} is not supported (2, 3 are)")
    return tensors, pairs


def _pairs(cursor: _Cursor, count: int, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for _ in range(count):
            key = cursor.string()
            out[key] = cursor.value(cursor.take("<I"))
    except UnicodeDecodeError as e:
        raise GGUFMetadataError(f"{path}: undecodable metadata string: {e}") from e
    return out


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of the file with its value (arrays as lists)."""
    with open(path, "rb") as f:
        _, count = _header(f, path)
        # The metadata has no length field: map the file and read pairs until the count is done.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            cursor.pos = 24
            return _pairs(cursor, count, path)


def read_gguf(path: Path) -> GGUFFile:
    """The metadata (as `read_gguf_metadata`) and every tensor, its data a view of the file.
    GGUFMetadataError for a file that is not GGUF, or whose directory is damaged: a tensor of an
    unknown type, named twice, or whose data would lie past the end of the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        n_tensors, n_pairs = _header(f, path)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            cursor.pos = 24
            metadata = _pairs(cursor, n_pairs, path)
            infos = []
            try:
                for _ in range(n_tensors):
                    name = cursor.string()
                    n_dims = cursor.take("<I")
                    if n_dims > _MAX_DIMS:
                        raise GGUFMetadataError(f"{path}: tensor {name} has {n_dims} dimensions")
                    dims = tuple(cursor.take("<Q") for _ in range(n_dims))
                    infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
            except UnicodeDecodeError as e:
                raise GGUFMetadataError(f"{path}: undecodable tensor name: {e}") from e
            end = cursor.pos
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFMetadataError(f"{path}: general.alignment {alignment!r} is not a power of two")
    start = -(-end // alignment) * alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, kind, offset in infos:
        if name in seen:
            raise GGUFMetadataError(f"{path}: tensor {name} is listed twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFMetadataError(f"{path}: tensor {name} has unknown type {kind}") from None
        n_bytes = math.prod(dims) * type_size // block
        at = start + offset
        if at + n_bytes > len(raw):
            raise GGUFMetadataError(f"{path}: tensor {name}'s data run past the end of the file")
        np_dims = tuple(reversed(dims))
        dtype = _PLAIN_TYPES.get(qtype.name)
        try:
            if dtype is None:  # (ValueError where a row is not whole blocks)
                view = raw[at : at + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
            else:
                view = raw[at : at + n_bytes].view(dtype).reshape(np_dims)
        except ValueError as e:
            raise GGUFMetadataError(f"{path}: tensor {name}'s shape {dims}: {e}") from e
        tensors.append(GGUFTensor(name, qtype, dims, n_bytes, view))
    return GGUFFile(metadata, tensors, start)


# Types whose data are plain numbers (gguf-py's reader gives them their dtype, the rest as bytes).
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
