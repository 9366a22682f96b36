"""The key/value metadata of a GGUF file, read without its tensors.

`gguf.GGUFReader` builds numpy views for every element of every array field (seconds for a 262k-token
vocabulary, ~13 s for Gemma's); reading the tokenizer alone needs only the values. Layout (GGUF v2/v3,
little-endian): magic "GGUF", version u32, tensor count u64, key/value count u64, then per pair a
string key, a u32 type and the value; strings are a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


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
        return [self.value(item) for _ in range(count)]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of the file with its value (arrays as lists)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise GGUFMetadataError(f"{path}: not a GGUF file")
        version, _, count = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise GGUFMetadataError(f"{path}: GGUF version {version} is not supported (2, 3 are)")
        # The metadata has no length field: map the file and read pairs until the count is done.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            cursor.pos = 24
            out: dict[str, Any] = {}
            try:
                for _ in range(count):
                    key = cursor.string()
                    out[key] = cursor.value(cursor.take("<I"))
            except UnicodeDecodeError as e:
                raise GGUFMetadataError(f"{path}: undecodable metadata string: {e}") from e
            return out
