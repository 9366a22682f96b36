"""AWQ and GPTQ 4-bit HF checkpoints (safetensors with qweight / qzeros / scales per linear layer)
→ inferd's int4 `QuantizedWeight` (w = q * scale + min, groups along K), by unpacking nibbles: no
detour through fp32 where the group fits inferd's kernels.

Layouts (K = in_features, N = out_features, g = group_size; int32 words hold 8 nibbles, nibble i
at bits 4i..4i+3; every format computes w[n, k] = (q - z) * s of its group):
- AWQ (AutoAWQ, version "gemm"): qweight [K, N/8] packs 8 output columns per word in the order
  0, 2, 4, 6, 1, 3, 5, 7; qzeros [K/g, N/8] likewise; scales [K/g, N] fp16.
- GPTQ (AutoGPTQ / GPTQModel): qweight [K/8, N] packs 8 consecutive input rows per word; qzeros
  [K/g, N/8] packs output columns in order and, in checkpoint format "gptq" (v1), stores z - 1
  ("gptq_v2" stores z); scales [K/g, N] fp16; g_idx [K] the group of each input row.
A group that is not a multiple of 32 dividing K, or an act-order g_idx (rows not in group order),
does not map onto inferd's blocks: such a weight is dequantized to fp32 (and `--quantization`
re-quantizes it as it would any fp32 weight).
"""

from __future__ import annotations

from typing import Any

import torch

from inferd.loader.weights import ModelLoadError
from inferd.quantization.formats import QuantizedWeight, pack_int4

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_REVERSE_ORDER = [
    0,
    4,
    1,
    5,
    2,
    6,
    3,
    7,
]  # column j of a word sits at nibble AWQ_REVERSE_ORDER[j]


def quant_method(config: dict[str, Any]) -> str | None:
    qc = config.get("quantization_config")
    return None if not qc else str(qc.get("quant_method", "")).lower()


def _unpack_columns(words: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C] → uint8 [R, 8C]: word c's nibbles are columns 8c..8c+7 (in `order`)."""
    nib = (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C, 8]
    if order is not None:
        nib = nib[..., order]
    return nib.to(torch.uint8).reshape(words.shape[0], -1)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → uint8 [8R, C]: word r's nibbles are rows 8r..8r+7."""
    nib = (words.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF  # [R, 8, C]
    return nib.to(torch.uint8).reshape(-1, words.shape[1])


def _int4_weight(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor, group: int,
                 keep: bool, source: str) -> torch.Tensor | QuantizedWeight:  # fmt: skip
    """q [K, N] 0..15, z [G, N], s [G, N], g_idx [K] → the [N, K] weight."""
    k, n = q.shape
    s = s.float()
    in_order = bool(torch.equal(g_idx, torch.arange(k) // group))
    if keep and in_order and group % 32 == 0 and k % group == 0:
        # w = q * s - z * s: scales and mins in fp32, so the product equals the format's exactly.
        return QuantizedWeight("int4", pack_int4(q.t().contiguous()), s.t().contiguous(),
                               (-z.float() * s).t().contiguous(), (n, k), group, source)  # fmt: skip
    idx = g_idx.long()
    return ((q.float() - z[idx].float()) * s[idx]).t().contiguous()


def convert(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], keep: bool
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Replace each layer's qweight/qzeros/scales[/g_idx] by `<layer>.weight`; other tensors pass."""
    qc = config["quantization_config"]
    method = quant_method(config)
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"unsupported quantization_config.quant_method {qc.get('quant_method')!r} "
                             "(inferd reads awq and gptq)")  # fmt: skip
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{method}: only 4-bit checkpoints are supported, got bits={bits}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(
            f"awq: only the 'gemm' packing is supported, got version {qc.get('version')!r}"
        )
    if method == "awq" and qc.get("zero_point") is False:
        raise ModelLoadError("awq: checkpoints without zero points are not supported")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    zero_offset = 1 if method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq" else 0
    source = f"{method.upper()} int4 group {group_size}"
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, t in tensors.items():
        if not name.endswith(".qweight"):
            if not name.endswith((".qzeros", ".scales", ".g_idx")):
                out[name] = t
            continue
        prefix = name.removesuffix(".qweight")
        try:
            qz, sc = tensors[prefix + ".qzeros"], tensors[prefix + ".scales"]
        except KeyError as e:
            raise ModelLoadError(f"{method}: {prefix} has a qweight but no {e.args[0]}") from e
        if method == "awq":
            q = _unpack_columns(t, AWQ_REVERSE_ORDER)
            z = _unpack_columns(qz, AWQ_REVERSE_ORDER)
        else:
            q = _unpack_rows(t)
            z = _unpack_columns(qz) + zero_offset
        k, n = q.shape
        group = k if group_size == -1 else group_size
        if sc.shape != (k // group, n) or z.shape != sc.shape:
            raise ModelLoadError(f"{method}: {prefix} has scales {tuple(sc.shape)} and zeros {tuple(z.shape)}, "
                                 f"expected {(k // group, n)} for a [{n}, {k}] weight in groups of {group}")  # fmt: skip
        g_idx = tensors.get(prefix + ".g_idx")
        g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
        out[prefix + ".weight"] = _int4_weight(q, z, sc, g_idx, group, keep, source)
    return out
