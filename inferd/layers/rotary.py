"""Rotary position embedding (HF half-split layout) with HF's frequency scalings: linear, llama3,
YaRN and LongRoPE."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from inferd.kernels.quant_gemm import extension as cpu_kernels

# HF's rope_scaling types this module computes; any other is an error, never ignored.
ROPE_SCALING_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The scaling's type by HF's name ("su", LongRoPE's old name, is "longrope"); ValueError
    for one not in ROPE_SCALING_TYPES."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    return kind


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: torch.Tensor | None = None,
    max_positions: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp64); `rope_parameters` gives the attention factor too."""
    return rope_parameters(head_dim, theta, scaling, freq_factors, max_positions)[0]


def rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: torch.Tensor | None = None,
    max_positions: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor: cos and sin are scaled by it) as HF computes them
    for each scaling type. LongRoPE takes its long factors when the engine's context
    (`max_positions`) is longer than the original one, its short factors otherwise: decided once
    per engine, as llama.cpp does, so a row's rotation never depends on the batch."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # GGUF's rope_freqs tensor: llama3 scaling precomputed
        return inv_freq / freq_factors.to(torch.float64), 1.0
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq, 1.0
    s = scaling or {}
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low = float(s.get("low_freq_factor", 1.0))
        high = float(s.get("high_freq_factor", 4.0))
        old_len = float(s.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, s)
    return _longrope(inv_freq, s, max_positions)


def _yarn(
    inv_freq: torch.Tensor, dim: int, base: float, s: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """HF's `_compute_yarn_parameters`: frequencies blended between interpolated (low) and
    extrapolated (high) by a linear ramp over the dimensions, and an attention factor."""
    factor = float(s["factor"])
    original = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def _longrope(
    inv_freq: torch.Tensor, s: dict[str, Any], max_positions: int | None
) -> tuple[torch.Tensor, float]:
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor")
    if factor is None:
        factor = float(s.get("max_position_embeddings", original)) / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = max_positions is not None and max_positions > original
    # fp32 factors, as transformers holds them.
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32).double()
    if ext.numel() != inv_freq.numel():
        raise ValueError(
            f"longrope factors: {ext.numel()} values for {inv_freq.numel()} frequencies"
        )
    return inv_freq / ext, float(attention)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; `forward` rotates q and k in place.

    The tables are stored at full head width, cos as [cos, cos] and sin as [-sin, sin], so that
    `apply_rotary` is x·cos + swap_halves(x)·sin: four elementwise kernels per layer instead of
    seven (batch-1 decode runs 30 of them per token), with bit-identical results (a - b·s and
    a + b·(-s) round alike)."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> None:  # fmt: skip
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        cos, sin = (
            (freqs.cos() * attention_factor).float(),
            (freqs.sin() * attention_factor).float(),
        )
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
