"""Plain linear and embedding layers whose parameters start empty: weights always come from a
checkpoint, so random initialisation (and the torch._dynamo import nn.Embedding's init triggers,
~1.8 s) is pure startup cost. Quantized linears implement the same `forward`.

A `Linear`'s matmul kernel is chosen once, from its weight's device and dtype and what this
machine has (`select_linear_backend`), at its first call after construction or a move / cast
(`Module.to`, `to_empty`); `forward` then calls it with no checks of its own. Swapping the weight
through `.data` for one of another dtype or device after that first call is not supported (the
engine only ever writes weights in place, or swaps in tensors like them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers import onednn_linear


class LinearBackend(ABC):
    """How a `Linear` multiplies: `forward(layer, x)` is x [..., K] · layer.weight^T (+ bias)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        """Whether this backend runs a layer with `weight` here."""

    @abstractmethod
    def forward(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


def _packed(layer: Linear, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """oneDNN from the layer's packed copy of its weight (made on its first many-row call)."""
    if layer._packed is None:
        layer._packed = onednn_linear.PackedWeight()
    y = layer._packed.linear(x2.contiguous(), layer.weight, layer.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DenseKernelLinear(LinearBackend):
    """fp32 on the CPU with the C++ kernels (csrc/dense_gemv.h), at any row count: the kernels
    the fused decode step runs too, which sum a row in one order however many rows a call has, so
    a prompt's last row gives the same bits in a full prefill, after a prefix-cache hit, in a
    chunk or in a decode batch."""

    name = "cpu-dense"

    def __init__(self) -> None:
        self.ext = cpu_kernels()

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.is_cpu and weight.dtype == torch.float32 and cpu_kernels() is not None

    def forward(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        y = self.ext.dense_linear(x2, layer.weight, layer.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class OneDnnLinear(LinearBackend):
    """fp32 on the CPU without the C++ kernels: oneDNN's packed weight for many rows, at::linear
    for one (no pack for a call that reads the weight once)."""

    name = "onednn"

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.is_cpu and weight.dtype == torch.float32 and onednn_linear.available()

    def forward(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > 1:
            return _packed(layer, x, x2)
        return F.linear(x, layer.weight, layer.bias)


class TorchLinear(LinearBackend):
    """at::linear: other dtypes and devices."""

    name = "torch"

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return True

    def forward(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


# In order of preference: the first that supports a weight takes it.
LINEAR_BACKENDS: dict[str, type[LinearBackend]] = {
    b.name: b for b in (DenseKernelLinear, OneDnnLinear, TorchLinear)
}


def select_linear_backend(weight: torch.Tensor) -> LinearBackend:
    """The preferred backend that runs `weight` here (a fresh instance: the oneDNN and kernel
    availability it reads are those of now)."""
    return next(b for b in LINEAR_BACKENDS.values() if b.supports(weight))()


def _select_then_forward(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    backend = select_linear_backend(layer.weight)
    layer.backend = backend
    layer._forward = backend.forward
    return backend.forward(layer, x)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._packed: onednn_linear.PackedWeight | None = None  # made on the first many-row call
        self.backend: LinearBackend | None = None  # chosen on the first call
        self._forward: Callable[[Linear, torch.Tensor], torch.Tensor] = _select_then_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self, x)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # Moved or cast: the kernel is chosen again, for the weight as it is then.
        self.backend, self._forward = None, _select_then_forward
        return super()._apply(fn, recurse)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
