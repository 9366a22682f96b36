"""What two engines must agree on before one's KV blocks can be copied into the other's pool.

A block is copied as raw bytes: element type, shape of a block (layers, K/V planes, block size,
KV heads, head dim) and the arithmetic that produced it (the model's weights and quantization)
must be the same on both sides, else the receiver would read garbage or a different model's
keys. `KVLayoutInfo.check_compatible` names every field that differs; the transfer handshake
(transport.py) refuses a pull whose layout is not the sender's.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


class KVLayoutMismatch(ValueError):
    """The two engines' KV layouts differ: their blocks cannot be exchanged."""


@dataclass(frozen=True, slots=True)
class KVLayoutInfo:
    storage_dtype: str  # the pool's element type ("float32", "uint8" for 1-byte formats ...)
    kv_cache_dtype: str  # --kv-cache-dtype ("auto", "int8", ...): how the elements are coded
    num_layers: int  # pool layers (one KV group's layers)
    num_planes: int  # 2 (K, V) or 1 (MLA latents)
    block_size: int
    num_kv_heads: int
    head_dim: int
    has_scales: bool
    fingerprint: str  # model_fingerprint(): the weights and quantization that computed the KV

    @classmethod
    def of(cls, kv_cache, kv_cache_dtype: str, block_size: int, fingerprint: str) -> KVLayoutInfo:
        """The layout of `kv_cache` (an inferd.kv.kv_cache.KVCache)."""
        layers, planes, _, bs, heads, head_dim = kv_cache.data.shape
        assert bs == block_size, f"pool block size {bs} != {block_size}"
        return cls(str(kv_cache.data.dtype).removeprefix("torch."), kv_cache_dtype, layers, planes,
                   block_size, heads, head_dim, kv_cache.scales is not None, fingerprint)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> KVLayoutInfo:
        """KVLayoutMismatch for a malformed description (a peer of another version)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict) or sorted(d) != sorted(names):
            raise KVLayoutMismatch(f"malformed KV layout from the peer: {d!r}")
        return cls(**d)

    def check_compatible(self, peer: KVLayoutInfo, peer_name: str = "the peer") -> None:
        """KVLayoutMismatch naming each field where `peer` differs from this layout."""
        diffs = [f"{f.name}: here {getattr(self, f.name)!r}, {peer_name} {getattr(peer, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(peer, f.name)]  # fmt: skip
        if diffs:
            raise KVLayoutMismatch(
                f"KV layouts differ, blocks cannot be transferred ({'; '.join(diffs)}): run the "
                "prefill and decode workers with the same model file, --quantization, "
                "--kv-cache-dtype, --dtype and --block-size"
            )


def model_fingerprint(model_config, quantization: str, dtype: torch.dtype, embed_rows: torch.Tensor) -> str:
    """A short digest of what computes the KV: the model's sizes, its quantization and compute
    dtype, and a few rows of its token embedding (`embed_rows`, exact bytes: two quantizations
    or two fine-tunes of one architecture differ there)."""
    h = hashlib.sha256()
    for key in ("name", "architecture", "num_layers", "hidden_size", "vocab_size", "num_kv_heads", "head_dim"):
        h.update(f"{key}={getattr(model_config, key, None)!r};".encode())
    h.update(f"quantization={quantization};dtype={dtype};".encode())
    h.update(embed_rows.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint_rows(vocab_size: int) -> torch.Tensor:
    """The token ids whose embedding rows `model_fingerprint` digests."""
    return torch.linspace(0, vocab_size - 1, 8).long()
