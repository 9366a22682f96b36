"""fp32 matmuls of many rows (prefill chunks, large verification batches) through oneDNN with the
weight packed once, where the engine's C++ kernels are not built (`OneDnnLinear`,
inferd/layers/linear.py; with them, `Linear` runs csrc/dense_gemv.h at every row count, whose
row-count-independent summation order this does not share).

PyTorch's CPU `F.linear` calls MKL's sgemm, which takes a generic path on AMD CPUs; oneDNN, which
PyTorch also ships for any x86 vendor, runs the same matmuls at 2-3x its speed there from a
packed weight (less from the plain one, which it re-packs every call). Each row's result does not
depend on how many rows a many-row call has.

The packed copy costs the weight's size again in memory (made on a layer's first call with more
than one row). `INFERD_ONEDNN_LINEAR=0` turns it off (at::linear then).
"""

from __future__ import annotations

import functools

import torch

from inferd import envs


@functools.cache
def available() -> bool:
    """oneDNN's packed linear is in this PyTorch build and agrees with at::linear (checked once)."""
    if not envs.INFERD_ONEDNN_LINEAR:
        return False
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):  # fmt: skip
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(80, 48, generator=gen)
        w = torch.randn(24, 48, generator=gen)
        b = torch.randn(24, generator=gen)
        y = linear_packed(x, pack(w), b)
        return bool(torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except RuntimeError:  # a build without the ops' CPU kernels
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight in oneDNN's blocked layout (an opaque tensor; the batch-size hint
    changed nothing measurable between 64 and 2,048 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] contiguous fp32 · the packed weight^T (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeight:
    """A layer's packed copy of its weight, remade when the weight is replaced or written in
    place (its version counter; a write through `.data` bypasses it, so loaders write the
    parameter itself)."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.key: tuple[int, int] | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] contiguous fp32 · weight^T (+ bias)."""
        key = (weight.data_ptr(), weight._version)
        if self.packed is None or key != self.key:
            self.packed, self.key = pack(weight), key
        return linear_packed(x, self.packed, bias)
