"""The fused dequantise-dot CPU kernels (csrc/quant_gemm.cpp), built on first use (see build.py).

Where they cannot be built (no compiler, not x86 with AVX2/FMA), `extension()` returns None after
one line on stderr and callers use the PyTorch fallback.
"""

from __future__ import annotations

import functools
from types import ModuleType

from inferd.kernels.build import load_extension


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, or None (with one line on stderr saying why) when unavailable."""
    return load_extension("quant_gemm", "quant_gemm.cpp", "the quantized CPU kernels")


@functools.cache
def extension_avx2() -> ModuleType | None:
    """The same kernels built without AVX-512 (the AVX2 `maddubs` integer path): what a CPU
    without AVX512-VNNI runs; the tests check it here too."""
    return load_extension(
        "quant_gemm_avx2",
        "quant_gemm.cpp",
        "the AVX2-only quantized CPU kernels",
        ("-mno-avx512f",),
    )
