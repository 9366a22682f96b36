"""Rotary position embedding (HF half-split layout) with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from inferd.kernels.quant_gemm import extension as cpu_kernels


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # GGUF's rope_freqs tensor: llama3 scaling precomputed
        return inv_freq / freq_factors.to(torch.float64)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; `forward` rotates q and k in place.

    The tables are stored at full head width, cos as [cos, cos] and sin as [-sin, sin], so that
    `apply_rotary` is x·cos + swap_halves(x)·sin: four elementwise kernels per layer instead of
    seven (batch-1 decode runs 30 of them per token), with bit-identical results (a - b·s and
    a + b·(-s) round alike)."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        cos, sin = freqs.cos().float(), freqs.sin().float()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)  # [P, D]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions, [T, 1, D]: looked up once per step, not per layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def select_rotary(device: torch.device, dtype: torch.dtype) -> Rotate:
    """The rotation for a model of `dtype` on `device`, chosen once: for fp32 on the CPU with the
    C++ kernels one loop (csrc/layer_ops.h), as the fused decode step runs it (it takes x
    [T, H, D] with unit stride along D, as the model's q/k views are); `rotate_torch` elsewhere."""
    ext = cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    return ext.rotary if ext is not None else rotate_torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (half-split layout: [x1, x2] → [x1·c - x2·s, x2·c + x1·s]) with the
    full-width tables of `RotaryEmbedding`; q and k heads can go through in one call. Picks the
    kernel per call, for callers holding no model; a model uses `select_rotary`'s."""
    if x.dtype == torch.float32 and x.is_cpu and x.dim() == 3 and x.stride(2) == 1:
        return select_rotary(x.device, x.dtype)(x, cos, sin)
    return rotate_torch(x, cos, sin)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in PyTorch ops (any dtype, device and layout)."""
    *lead, d = x.shape
    xf = x.float()  # no copy when x is fp32
    # swap_halves as one flip of a [.., 2, D/2] view: a fresh tensor, so the products can be taken
    # in place; 4 kernels instead of 6 (two slices and a cat), same values, same rounding order.
    swapped = xf.view(*lead, 2, d // 2).flip(-2).view(*lead, d)
    out = torch.mul(xf, cos).add_(swapped.mul_(sin))
    return out if out.dtype == x.dtype else out.to(x.dtype)
