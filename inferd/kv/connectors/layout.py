"""What two ends of a KV transfer must agree on before a block moves: the model that computed it
and how the pool lays a block out. A KV tier keys its files by it (with the block's hash chain),
so a restarted server or a replica of the same model and layout reuses them and any other never
does; a PD handshake compares it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import asdict, dataclass

import torch

from inferd.kv.kv_cache import kv_format, storage_dtype

# Elements of each weight hashed into the fingerprint (its leading ones): enough to tell two
# checkpoints of one architecture apart, cheap enough to compute at every start.
_SAMPLE = 256


def model_fingerprint(config, weights: dict, compute: str) -> str:
    """A hex digest of a model as the engine computes it: its config, every weight's name and
    shape, a sample of each weight's values (as loaded, before any repacking), and `compute` (what
    else changes the KV: dtype, weight quantization)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(config).encode())
    h.update(compute.encode())
    for name in sorted(weights):
        w = weights[name]
        parts = [w] if isinstance(w, torch.Tensor) else [w.data, w.scales]
        h.update(name.encode() + repr(tuple(getattr(w, "shape", ()))).encode())
        for t in parts:
            sample = t.detach().reshape(-1)[:_SAMPLE].cpu().contiguous()
            h.update(str(sample.dtype).encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class KVBlockLayout:
    """One block position's KV as the pool holds it: per KV group, `group_layers` layers of
    `planes` (K, V) × block_size × kv_heads × head_dim elements of `kv_dtype`, plus one fp32 scale
    per (layer, plane, slot, head) when `scaled` (int8 / fp8 caches)."""

    model_fingerprint: str
    kv_dtype: str  # the stored format: "float32", "bfloat16", "int8", "fp8_e4m3", ...
    block_size: int
    num_groups: int
    group_layers: int
    planes: int
    kv_heads: int
    head_dim: int
    scaled: bool

    @classmethod
    def of(cls, fingerprint: str, model_config, kv_layout, block_size: int, kv_cache_dtype: str,
           dtype: torch.dtype) -> KVBlockLayout:  # fmt: skip
        fmt = kv_format(kv_cache_dtype)
        stored = (
            fmt.name
            if fmt is not None
            else str(storage_dtype(kv_cache_dtype, dtype)).removeprefix("torch.")
        )
        planes, heads, head_dim = model_config.kv_layout()
        return cls(fingerprint, stored, block_size, kv_layout.num_groups, kv_layout.group_size, planes, heads,
                   head_dim, fmt is not None)  # fmt: skip

    @property
    def data_shape(self) -> tuple[int, ...]:
        """One block position's data: [groups, layers, planes, block_size, kv_heads, head_dim]."""
        return (
            self.num_groups,
            self.group_layers,
            self.planes,
            self.block_size,
            self.kv_heads,
            self.head_dim,
        )

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.data_shape[:-1]

    def key(self) -> bytes:
        """16 bytes naming this layout (every field)."""
        return hashlib.blake2b(repr(sorted(asdict(self).items())).encode(), digest_size=16).digest()

    def block_key(self, block_hash: int) -> str:
        """The content address of the block whose chained hash is `block_hash` under this layout."""
        h = hashlib.blake2b(self.key() + struct.pack("<Q", block_hash), digest_size=16)
        return h.hexdigest()

    def describe(self) -> str:
        return (f"{self.kv_dtype}{' + scales' if self.scaled else ''}, block {self.block_size}, "
                f"{self.num_groups}x{self.group_layers} layers, {self.planes} planes, {self.kv_heads} heads x "
                f"{self.head_dim}, model {self.model_fingerprint[:12]}")  # fmt: skip
