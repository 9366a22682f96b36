"""Quantized drop-ins for `Linear` and `Embedding`: same `forward`, weights kept packed.

`QuantizedLinear` runs the fused dequantise-dot CPU kernels (inferd/kernels) for fp32 input on
CPU and dequantise-then-matmul elsewhere (CUDA, bf16, no compiler). A tied embedding shares the
head's `QuantizedWeight` and dequantises only the rows it looks up.
"""

from __future__ import annotations

import torch
from torch import nn

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


def prepare_quantized_kernels(model: nn.Module) -> None:
    """One tiny call per quantized matmul, so that whatever the kernels build on a weight's first
    call (the int8 path's packed tiles: ~50 ms for the default model) happens at start-up rather
    than in the first request's time to first token."""
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                quantized_matmul(torch.zeros(1, module.in_features), module.qweight)
