"""The KV tier's storage: blocks' KV in host memory (an LRU within a byte budget) and in files
under a directory (an LRU within a size limit, by access time), content-addressed.

A block's address is `KVBlockLayout.block_key(hash)`: its chained token hash (inferd/kv/block_hash.py,
the prefix cache's) under the model fingerprint and the pool's layout, so the same prefix of the
same model in the same layout has the same name in every process that shares the directory, and
no other block ever does. A file is

    magic (8 bytes) | header length (u32) | header (JSON: layout, hash, dtypes, sizes, checksum)
    | data bytes | scale bytes

written to a temporary name and renamed into place (a reader never sees half a file). A file that
is truncated, fails its checksum, or whose header names another layout or block is skipped with
one warning (per file) and never used: that block is recomputed. Access time is the file's mtime
(set on every hit), so the LRU survives restarts and works on filesystems mounted noatime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inferd.kv.connectors.layout import KVBlockLayout

logger = logging.getLogger("inferd.kv.tier")

MAGIC = b"INFERDKV"
_SUFFIX = ".kvb"
_VERSION = 1


@dataclass(slots=True)
class BlockKV:
    """One block position's KV, as `KVBlockLayout.data_shape` / `scale_shape` say (host memory)."""

    data: torch.Tensor
    scales: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class HostStore:
    """Blocks in host memory, least recently used dropped past `capacity` bytes. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[str, BlockKV] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> BlockKV | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: str, block: BlockKV) -> None:
        if block.nbytes > self.capacity:
            return
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = block
            self.nbytes += block.nbytes
            while self.nbytes > self.capacity:
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evictions += 1


class DiskStore:
    """Block files under `directory`, at most `size_limit` bytes of them (least recently used
    removed first). Thread-safe; several processes may share the directory."""

    def __init__(self, directory: str, size_limit: int, layout: KVBlockLayout) -> None:
        self.dir = os.path.abspath(directory)
        self.size_limit = size_limit
        self.layout = layout
        self._header_layout = dataclasses.asdict(layout)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            raise ValueError(
                f"--kv-offload-dir {directory}: not a writable directory ({e.strerror or e})"
            ) from None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._unsound: set[str] = set()  # files that failed a read: not offered until rewritten
        self.bytes_written = self.bytes_read = self.evictions = self.rejected = 0
        # name → size, least recently used first (by mtime: the access time this store keeps)
        entries = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(_SUFFIX) and e.is_file():
                    st = e.stat()
                    entries.append((st.st_mtime_ns, e.name, st.st_size))
        entries.sort()
        self._index: OrderedDict[str, int] = OrderedDict((name, size) for _, name, size in entries)
        self.nbytes = sum(self._index.values())
        with self._lock:
            self._evict_over_limit()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + _SUFFIX)

    def __contains__(self, key: str) -> bool:
        return key + _SUFFIX in self._index or os.path.exists(self._path(key))

    def holds(self, block_hash: int) -> bool:
        """Whether a file names this block and has not failed a read (unverified: `read` checks)."""
        key = self.layout.block_key(block_hash)
        return key + _SUFFIX not in self._unsound and key in self

    def _warn(self, name: str, why: str) -> None:
        self.rejected += 1
        self._unsound.add(name)
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "KV tier: %s %s; ignored (the block is recomputed)",
                os.path.join(self.dir, name),
                why,
            )

    def read(self, block_hash: int) -> BlockKV | None:
        """The block's KV from its file, or None: no file, or one that is not sound (warned)."""
        key = self.layout.block_key(block_hash)
        name, path = key + _SUFFIX, self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # removed meanwhile (another process sharing the directory)
            with self._lock:
                self.nbytes -= self._index.pop(name, 0)
            return None
        except OSError as e:
            self._warn(name, f"cannot be read ({e.strerror})")
            return None
        block = self._decode(name, raw, block_hash)
        if block is None:
            return None
        with self._lock:
            self.bytes_read += len(raw)
            self._index[name] = len(raw)
            self._index.move_to_end(name)
        try:
            os.utime(path)  # its access time, for the LRU
        except OSError:
            pass
        return block

    def _decode(self, name: str, raw: bytes, block_hash: int) -> BlockKV | None:
        lay = self.layout
        if len(raw) < 12 or raw[:8] != MAGIC:
            self._warn(name, "is not a KV block file")
            return None
        (hlen,) = struct.unpack_from("<I", raw, 8)
        try:
            header = json.loads(raw[12 : 12 + hlen])
        except ValueError:
            self._warn(name, "has a damaged header")
            return None
        if not isinstance(header, dict) or header.get("version") != _VERSION:
            self._warn(name, "has an unknown format version")
            return None
        if header.get("layout") != self._header_layout:
            self._warn(name, "was written for another model or KV layout")
            return None
        if header.get("block_hash") != block_hash:
            self._warn(name, "holds another block")
            return None
        payload = raw[12 + hlen :]
        data_n, scale_n = header.get("data_nbytes", -1), header.get("scale_nbytes", -1)
        if len(payload) != data_n + scale_n:
            self._warn(name, f"is truncated ({len(payload)} of {data_n + scale_n} payload bytes)")
            return None
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
            self._warn(name, "fails its checksum")
            return None
        try:
            dtype = getattr(torch, header["data_dtype"])
            buf = bytearray(payload)
            data = (
                torch.frombuffer(buf, dtype=torch.uint8, count=data_n)
                .view(dtype)
                .view(lay.data_shape)
            )
            scales = None
            if lay.scaled:
                scales = torch.frombuffer(buf, dtype=torch.float32, offset=data_n).view(
                    lay.scale_shape
                )
        except (AttributeError, RuntimeError, TypeError, ValueError) as e:
            self._warn(name, f"does not match the layout ({e})")
            return None
        return BlockKV(data, scales)

    def write(self, block_hash: int, block: BlockKV) -> bool:
        """Store the block (atomically); an existing file is only touched. False: not written."""
        key = self.layout.block_key(block_hash)
        name, path = key + _SUFFIX, self._path(key)
        if name in self._index and name not in self._unsound and os.path.exists(path):
            try:
                os.utime(path)
            except OSError:
                pass
            with self._lock:
                self._index.move_to_end(name)
            return False
        data = _raw(block.data)
        scales = _raw(block.scales) if block.scales is not None else b""
        payload = data + scales
        header = json.dumps({
            "version": _VERSION, "layout": self._header_layout, "block_hash": block_hash,
            "data_dtype": str(block.data.dtype).removeprefix("torch."), "data_nbytes": len(data),
            "scale_nbytes": len(scales), "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }).encode()  # fmt: skip
        size = 12 + len(header) + len(payload)
        if size > self.size_limit:
            return False
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{threading.get_ident()}-{key}")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("KV tier: cannot write %s (%s)", path, e.strerror or e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            self._unsound.discard(name)
            old = self._index.pop(name, 0)
            self._index[name] = size
            self.nbytes += size - old
            self.bytes_written += size
            self._evict_over_limit()
        return True

    def _evict_over_limit(self) -> None:
        while self.nbytes > self.size_limit and self._index:
            name, size = self._index.popitem(last=False)
            self.nbytes -= size
            try:
                os.unlink(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
            self.evictions += 1
