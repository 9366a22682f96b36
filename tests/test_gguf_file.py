"""inferd's GGUF reader (inferd/loader/gguf_file.py) reads what gguf-py's GGUFReader reads: every
metadata value, and every tensor's name, type, shape, size and bytes, for each weight type the
tiny models are written in; and a damaged directory is a GGUFMetadataError, not a crash."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from inferd.loader.gguf_file import GGUFMetadataError, read_gguf


@pytest.mark.parametrize(
    "name", ["llama-f32.gguf", "llama-f16.gguf", "qwen2-mixed.gguf", "llama-kquants.gguf",
             "llama-lowbit.gguf", "llama-tied-q4_1.gguf"],
)  # fmt: skip
def test_reads_what_gguf_py_reads(tiny_models, name: str) -> None:
    path = tiny_models[name].path
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.data_offset == theirs.data_offset
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.n_bytes) == (b.tensor_type, tuple(map(int, b.shape)), int(b.n_bytes))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    assert len({t.tensor_type for t in ours.tensors}) > 1 or name == "llama-f32.gguf"


def _tensor_info_at(data: bytes, name: str) -> int:
    """Where `name`'s directory entry starts (its u64 length)."""
    return data.index(name.encode()) - 8


def test_a_damaged_directory_is_an_error(tiny_models, tmp_path) -> None:
    data = tiny_models["llama-f32.gguf"].path.read_bytes()
    first = gguf.GGUFReader(str(tiny_models["llama-f32.gguf"].path)).tensors[0].name
    at = _tensor_info_at(data, first) + 8 + len(first)  # its dimension count
    cases = {
        "dims.gguf": (at, struct.pack("<I", 1000)),
        "type.gguf": (at + 4 + 8 * struct.unpack_from("<I", data, at)[0], struct.pack("<I", 999)),
        "offset.gguf": (at + 8 + 8 * struct.unpack_from("<I", data, at)[0], struct.pack("<Q", 1 << 40)),
    }  # fmt: skip
    for file, (pos, patch) in cases.items():
        path = tmp_path / file
        path.write_bytes(data[:pos] + patch + data[pos + len(patch) :])
        with pytest.raises(GGUFMetadataError, match=str(path)):
            read_gguf(path)


def test_a_quantized_row_of_partial_blocks_is_an_error(tiny_models, tmp_path) -> None:
    source = tiny_models["llama-tied-q4_1.gguf"].path
    data = source.read_bytes()
    first = next(t for t in gguf.GGUFReader(str(source)).tensors if t.tensor_type.name == "Q4_1")
    at = _tensor_info_at(data, first.name) + 8 + len(first.name) + 4  # its fastest dimension
    path = tmp_path / "partial.gguf"
    path.write_bytes(data[:at] + struct.pack("<Q", int(first.shape[0]) - 1) + data[at + 8 :])
    with pytest.raises(GGUFMetadataError, match=f"{first.name}'s shape"):
        read_gguf(path)


def test_a_big_endian_file_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(GGUFMetadataError, match="big-endian"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # the same, little-endian: empty
    assert (read_gguf(path).metadata, read_gguf(path).tensors) == ({}, [])
