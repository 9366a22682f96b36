"""GGUF blocks of the types `gguf.quants.quantize` cannot write (Q4_K, Q5_K, Q6_K; Q2_K, Q3_K, IQ4_NL),
written from llama.cpp's block layouts (ggml-common.h) for the tests' tiny models.

The K-quant writers are plain min/max (Q4_K, Q5_K) and absmax (Q6_K) quantizers, not llama.cpp's
error search: valid blocks whose `gguf.quants.dequantize` is near the input, which is all a test
model needs. Q2_K, Q3_K and IQ4_NL get random codes under sane fp16 scales (`random_blocks`): the
engine only dequantizes them. Nothing here imports the engine.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

# Byte offsets of each type's fp16 scales inside a block (everything else may be any bits).
_HALVES = {
    QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
    QType.Q6_K: (208,), QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.IQ4_NL: (0,),
}  # fmt: skip


def random_blocks(
    shape: tuple[int, int], qtype: QType, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:
    """uint8 [N, K / block · bytes]: random codes (every bit pattern), fp16 scales ~ N(0, scale)."""
    n, k = shape
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in _HALVES[qtype]:
        d = (rng.standard_normal((n, k // block)) * scale).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def _safe(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, v, 1.0)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit sc, m [..., 8] → Q4_K / Q5_K's 12 bytes (the inverse of get_scale_min_k4)."""
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _halves(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)[..., None].view(np.uint8)


def quantize_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5): per 32 weights a 6-bit scale and min under per-256 fp16 d, dmin."""
    n, k = x.shape
    levels = (1 << bits) - 1
    sub = x.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    step = (hi - lo) / levels
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / _safe(d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / _safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    s = d[..., None] * sc
    q = np.round((sub + (dmin[..., None] * mn)[..., None]) / _safe(s)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)  # [n, super-blocks, 8, 32]
    qs = (q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)  # 4 chunks of 32 bytes
    parts = [_halves(d), _halves(dmin), _pack_scale_min(sc, mn)]
    if bits == 5:  # bit j of byte l: sub-block j, weight l
        parts.append(
            (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)
        )
    parts.append(qs.reshape(n, k // 256, 128))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: per 16 weights an int8 scale under a per-256 fp16 d; codes 0..63 (value q - 32)."""
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16).astype(np.float32)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / _safe(d)[..., None]), 0, 127).astype(np.int8)
    s = d[..., None] * sc
    q = (np.clip(np.round(sub / _safe(s)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)  # [.., half, quarter, 32]: weight 128 h + 32 j + l
    ql = np.concatenate([q[:, :, :, 0] & 0x0F | (q[:, :, :, 2] & 0x0F) << 4,
                         q[:, :, :, 1] & 0x0F | (q[:, :, :, 3] & 0x0F) << 4], axis=-1)  # fmt: skip
    qh = (
        (q[:, :, :, 0] >> 4)
        | (q[:, :, :, 1] >> 4) << 2
        | (q[:, :, :, 2] >> 4) << 4
        | (q[:, :, :, 3] >> 4) << 6
    )
    parts = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _halves(d)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_blocks(
    x: np.ndarray, qtype: QType, rng: np.random.Generator | None = None
) -> np.ndarray:
    """GGUF bytes of `x` [N, K] in `qtype`: gguf's own quantizer where it has one, else the writers
    above (random blocks for Q2_K, Q3_K and IQ4_NL)."""
    import gguf

    if qtype in (QType.Q4_K, QType.Q5_K):
        return quantize_k(x, 4 if qtype == QType.Q4_K else 5)
    if qtype == QType.Q6_K:
        return quantize_q6_k(x)
    if qtype in (QType.Q2_K, QType.Q3_K, QType.IQ4_NL):
        return random_blocks(
            x.shape, qtype, rng or np.random.default_rng(0), scale=float(np.abs(x).max()) / 8
        )
    return gguf.quants.quantize(x, qtype)
