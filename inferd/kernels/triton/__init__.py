"""Triton kernels for the CUDA path (`pip install inferd[gpu]`): paged short-query attention
(paged_attention.py) and weight-only quantized GEMMs (quant_gemm.py). They run on CUDA tensors,
and on CPU tensors under `TRITON_INTERPRET=1` (the tests); nothing imports triton on the CPU path.

`cuda_quant_matmul` is the quantized linears' CUDA entry; a CUDA path that falls back to PyTorch
says so once through inferd.slow_paths.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from inferd.slow_paths import warn_slow_path


@functools.cache
def available() -> bool:
    """Whether triton is installed (the `gpu` extra)."""
    return importlib.util.find_spec("triton") is not None


def cuda_quant_matmul(x: torch.Tensor, w) -> torch.Tensor | None:
    """x [..., K] · dequant(w)^T by the Triton GEMM for a `QuantizedWeight` w in the row layout
    of a format it reads; None (after one warning) where it cannot: the caller dequantises."""
    from inferd.kernels.triton.quant_gemm import FORMATS

    if not available():
        warn_slow_path("triton-missing-gemm", "quantized linears dequantise their whole weight every call on "
                       f"{x.device.type} (install inferd[gpu] for the Triton kernels)")  # fmt: skip
        return None
    if w.format not in FORMATS or w.layout != "rows" or x.dtype not in _DTYPES:
        warn_slow_path(f"triton-gemm-{w.format}-{w.layout}-{x.dtype}", f"no Triton GEMM for {w.format} weights ({w.layout}) with {x.dtype} "
                       "activations: dequantising the whole weight every call")  # fmt: skip
        return None
    from inferd.kernels.triton.quant_gemm import quant_gemm

    x2 = x.reshape(-1, x.shape[-1])
    y = quant_gemm(x2, w.format, w.data, w.scales, w.mins, w.group, w.shape[0])
    return y.view(*x.shape[:-1], w.shape[0])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
