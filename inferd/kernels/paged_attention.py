"""The C++ paged attention for short queries (csrc/paged_attention.h), the "cpu" attention
backend's `kernel` (inferd/layers/attention.py): part of the CPU kernels' extension
(inferd/kernels/quant_gemm.py), built on first use."""

from __future__ import annotations

from types import ModuleType

from inferd.kernels import quant_gemm


def extension() -> ModuleType | None:
    return quant_gemm.extension()
