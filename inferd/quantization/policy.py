"""`--quantization`: what each linear layer stores, decided once at load.

Modes:
- "none": every weight dequantised to the compute dtype (fp32 on these CPUs).
- "auto" (default): keep a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K tensors packed
  (formats.GGUF_PACKED; fused kernels serve them); everything else as in "none". An fp32/fp16/bf16
  checkpoint therefore runs unquantized. A fused layer (qkv, gate_up) of parts in different types
  takes one common format: int8 blocks of 32, exactly where every part is Q8_0 or Q5_0.
- "int8" (per-channel), "int4" (group-wise asymmetric, `group` 32/64/128), "fp8" (E4M3, an fp32
  scale per `group` weights):
  every linear layer in that format. GGUF blocks that already are that format are kept as
  shipped; others are dequantised and re-quantised. The output head (and a tied embedding, which
  shares it) uses int8 in "int4" and "fp8" modes: logits are the most sensitive matmul (as in
  llama.cpp); on SmolLM2-135M an fp8 head alone costs ~3% perplexity, an int8 one ~0.5%.
  fp8 runs a fused kernel too (E4M3 decoded in registers), not dequantise-then-matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.quantization import gguf_blocks
from inferd.quantization.formats import (
    QuantizedWeight,
    bytes_of,
    cat_rows,
    dequantize,
    quantize,
    quantize_int8_blocks,
)

QUANTIZATION_MODES = ("auto", "none", "int8", "int4", "fp8")
INT4_GROUPS = (32, 64, 128)


def keeps_file_quantization(mode: str) -> bool:
    """Whether the loader should hand over GGUF blocks as they are (else fp32)."""
    return mode != "none"


def _compatible(parts: list[QuantizedWeight]) -> bool:
    f = parts[0]
    return all(p.format == f.format and p.group == f.group and p.scales.dtype == f.scales.dtype
               for p in parts)  # fmt: skip


def _fp32(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor:
    ts = [dequantize(p).float() for p in parts]
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def linear_weight(
    parts: list[torch.Tensor | QuantizedWeight], mode: str, group: int = 32, head: bool = False
) -> torch.Tensor | QuantizedWeight:
    """The weight a (fused) linear layer stores, from its parts stacked along the output dim."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if mode == "none":
        return _fp32(parts)
    if mode == "auto":
        if len(quantized) == len(parts) and _compatible(quantized):
            return quantized[0] if len(parts) == 1 else cat_rows(quantized)
        if len(quantized) == len(parts):  # a fused layer of mixed blocks: one common format
            widened = [gguf_blocks.widen_to_int8(p) or p for p in quantized]
            if _compatible(widened) and widened[0].format == "int8" and widened[0].group == 32:
                return cat_rows(widened)  # Q5_0 beside Q8_0: its very values as int8 blocks
            return quantize_int8_blocks(_fp32(parts))
        return _fp32(parts)
    fmt = "int8" if (mode in ("int4", "fp8") and head) else mode
    if fmt not in ("int8", "int4", "fp8"):
        raise ValueError(f"unknown quantization mode {mode!r}")
    keep = len(quantized) == len(parts) and _compatible(quantized) and quantized[0].format == fmt
    if keep and (fmt != "int4" or quantized[0].group == group):
        return quantized[0] if len(parts) == 1 else cat_rows(quantized)
    w = _fp32(parts)
    if fmt in ("int4", "fp8"):
        # A layer whose input dim the group does not divide takes the next smaller group size.
        group = next((g for g in (group, 64, 32) if g <= group and w.shape[1] % g == 0), group)
    return quantize(w, fmt, group)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model keeps (tied tensors counted once)."""
    from inferd.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear

    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already skips tied duplicates
        total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and id(m.qweight) not in seen:
            seen.add(id(m.qweight))
            total += bytes_of(m.qweight)
    return total


def describe(model: nn.Module) -> str:
    """e.g. 'int4 group 32 (GGUF Q4_1)×210, int8 group 32 (GGUF Q8_0)×1, fp32×61'."""
    from collections import Counter

    from inferd.layers.linear import Linear
    from inferd.layers.quantized_linear import QuantizedLinear

    kinds: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            w = m.qweight
            kinds[f"{w.format} g{w.group} ({w.source})"] += 1
        elif isinstance(m, Linear):
            kinds[str(m.weight.dtype).removeprefix("torch.")] += 1
    return ", ".join(f"{k}×{v}" for k, v in kinds.most_common())


def weight_bytes_by_mode(weights: dict, tied: bool, group: int = 32) -> dict[str, int]:
    """Resident weight bytes of each --quantization mode, computed from shapes (nothing is built);
    equals `resident_weight_bytes` of the built model up to fused layers of mixed blocks."""
    out: dict[str, int] = {}
    for mode in QUANTIZATION_MODES:
        total = 0
        for name, w in weights.items():
            is_head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
            linear = is_head or name.endswith("proj.weight")
            if not linear:  # norms, biases, an untied embedding (kept as loaded unless "none")
                total += bytes_of(w) if mode != "none" else _fp32_bytes(w)
                continue
            total += _linear_bytes(w, mode, group, is_head)
        out[mode] = total
    return out


def _fp32_bytes(w) -> int:
    n = w.shape[0] * w.shape[1] if isinstance(w, QuantizedWeight) else w.numel()
    return 4 * n


def _linear_bytes(w, mode: str, group: int, head: bool) -> int:
    native = isinstance(w, QuantizedWeight)
    n, k = w.shape
    if mode == "none" or (mode == "auto" and not native):
        return 4 * n * k
    if mode == "auto":
        return w.nbytes
    fmt = "int8" if (mode in ("int4", "fp8") and head) else mode
    if native and w.format == fmt and (fmt != "int4" or w.group == group):
        return w.nbytes
    g = next((g for g in (group, 64, 32) if g <= group and k % g == 0), group)
    if fmt == "int4":
        return n * k // 2 + 4 * n * (k // g)
    if fmt == "fp8":
        return n * k + 4 * n * (k // g)  # a byte per weight + an fp32 scale per group
    return n * k + 4 * n  # int8 per-channel: a byte per weight + an fp32 scale per row
