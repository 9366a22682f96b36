"""Quantized drop-ins for `Linear` and `Embedding`: same `forward`, weights kept packed.

`QuantizedLinear` runs the fused dequantise-dot CPU kernels (inferd/kernels) for fp32 input on
CPU and dequantise-then-matmul elsewhere (CUDA, bf16, no compiler). A tied embedding shares the
head's `QuantizedWeight` and dequantises only the rows it looks up.
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.quantization import formats
from inferd.quantization.formats import QuantizedWeight, dequantize_rows, quantized_matmul


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        # Plain attributes, not buffers: `Module.to(dtype)` must never cast packed data or scales.
        self.qweight = weight
        self.out_features, self.in_features = weight.shape
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias  # the same Parameter the plain Linear had: loading copies into it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quantized_matmul(x, self.qweight)
        return y + self.bias if self.bias is not None else y

    @property
    def weight_nbytes(self) -> int:
        return self.qweight.nbytes

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in={self.in_features}, out={self.out_features}, {w.format} group={w.group} ({w.source})"


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return dequantize_rows(self.qweight, flat).to(self.dtype).view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.qweight.shape}, {self.qweight.format} ({self.qweight.source})"


def pack_quantized_weights(model: nn.Module) -> int:
    """Rearrange every int8 / int4 `QuantizedLinear` weight into the packed tiles of the
    AVX512-VNNI kernels (`formats.pack_tiles`), in place of the row layout: no second copy. A
    tied embedding keeps sharing the head's weight (it dequantises its rows from the tiles).
    Nothing is packed where int8 activations are forced off (tiles have no fp32-activation
    kernel) or the kernels lack tiles. Returns how many weights were packed."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    packed: dict[int, QuantizedWeight] = {}
    for m in linears:
        if id(m.qweight) not in packed:
            tiles = formats.pack_tiles(m.qweight)
            if tiles is None:
                continue
            packed[id(m.qweight)] = tiles
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and id(m.qweight) in packed:
            m.qweight = packed[id(m.qweight)]
    if packed and hasattr(model, "weights_repacked"):
        model.weights_repacked()
    return len(packed)
