"""RMSNorm, computed in fp32 whatever the weight dtype (as HF does).

The kernel is chosen once, from the weight's device and dtype and what this machine has
(`select_norm_backend`), at the first call after construction or a move / cast (`Module.to`); the
same contract as `Linear`'s (inferd/layers/linear.py). The fp32 kernels take fp32 input only: any
other input gets the upcasting formula, as a non-fp32 weight does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Self

import torch

from inferd.kernels.quant_gemm import extension as cpu_kernels


class NormBackend(ABC):
    """How an `RMSNorm` normalises: `forward(norm, x)` over x's last dimension."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        """Whether this backend runs a norm with `weight` here."""

    @abstractmethod
    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor: ...


def _upcast(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """HF's formula: normalised in fp32, rounded to x's dtype, then scaled by the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x.to(dtype)


def _composite(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """fp32 in 5 PyTorch ops, the bits of ATen's CPU torch.rms_norm (no fused kernel there: a
    composite of 12 ops, pow, mean = sum + div_, add_, rsqrt, 2 mul, 6 dtype casts; x * x is what
    pow(x, 2) computes), at about half its cost per call."""
    v = (x * x).mean(-1, keepdim=True)
    return (x * v.add_(norm.eps).rsqrt_()).mul_(norm.weight)


class CpuKernelNorm(NormBackend):
    """fp32 on the CPU with the C++ kernels: one loop per row (csrc/layer_ops.h), the op the
    fused decode step runs, so both paths give the same bits (rows of a 2-D matrix, or heads of a
    [T, H, D] one); other layouts go through the 5-op composite."""

    name = "cpu"

    def __init__(self) -> None:
        self.ext = cpu_kernels()

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.is_cpu and weight.dtype == torch.float32 and cpu_kernels() is not None

    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return _upcast(norm, x)
        if x.dim() == 2 and x.stride(1) == 1:
            return self.ext.rms_norm(x, norm.weight, norm.eps)
        if x.dim() == 3 and x.stride(2) == 1:  # heads [T, H, D] (qk-norm): each as a row
            return self.ext.rms_norm_heads(x, norm.weight, norm.eps)
        return _composite(norm, x)


class CompositeNorm(NormBackend):
    """fp32 on the CPU without the C++ kernels: the 5-op composite."""

    name = "cpu-composite"

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.is_cpu and weight.dtype == torch.float32

    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return _composite(norm, x) if x.dtype == torch.float32 else _upcast(norm, x)


class FusedNorm(NormBackend):
    """fp32 elsewhere (CUDA): torch.rms_norm, which may be fused there, with its own rounding."""

    name = "torch-fused"

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32

    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return _upcast(norm, x)
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


class UpcastNorm(NormBackend):
    """Any other weight dtype: HF's formula."""

    name = "upcast"

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return True

    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return _upcast(norm, x)


# In order of preference: the first that supports a weight takes it.
NORM_BACKENDS: dict[str, type[NormBackend]] = {
    b.name: b for b in (CpuKernelNorm, CompositeNorm, FusedNorm, UpcastNorm)
}


def select_norm_backend(weight: torch.Tensor) -> NormBackend:
    """The preferred backend that runs `weight` here."""
    return next(b for b in NORM_BACKENDS.values() if b.supports(weight))()


def _select_then_forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    backend = select_norm_backend(norm.weight)
    norm.backend = backend
    norm._forward = backend.forward
    return backend.forward(norm, x)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.backend: NormBackend | None = None  # chosen on the first call
        self._forward: Callable[[RMSNorm, torch.Tensor], torch.Tensor] = _select_then_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self, x)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # Moved or cast: the kernel is chosen again, for the weight as it is then.
        self.backend, self._forward = None, _select_then_forward
        return super()._apply(fn, recurse)
