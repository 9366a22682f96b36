"""Plain linear and embedding layers whose parameters start empty: weights always come from a
checkpoint, so random initialisation (and the torch._dynamo import nn.Embedding's init triggers,
~1.8 s) is pure startup cost. Quantized linears will implement the same `forward`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers import onednn_linear


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._packed: onednn_linear.PackedWeight | None = None  # made on the first many-row call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.is_cpu and x.dtype == torch.float32 and w.dtype == torch.float32:
            ext = cpu_kernels()
            x2 = x.reshape(-1, x.shape[-1])
            if ext is not None and x2.shape[0] <= ext.dense_gemm_max_rows:
                # Up to 64 rows (decodes, verified drafts): the kernels the fused decode step
                # runs too (csrc/dense_gemv.h, dense_gemm.h), so both paths give the same bits.
                y = ext.dense_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, self.bias)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            if onednn_linear.available() and x2.shape[0] > 1:
                # More rows (prefill): oneDNN from a packed weight, 2-3x MKL's sgemm on AMD CPUs.
                if self._packed is None:
                    self._packed = onednn_linear.PackedWeight()
                y = self._packed.linear(x2.contiguous(), w, self.bias)
                return y.reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, w, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
