"""inferd's CPU kernels (csrc/cpu_kernels.cpp: quantized matmuls, paged attention, the decode
step's decoder layers), built on first use (see build.py).

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
    return load_extension("cpu_kernels", "cpu_kernels.cpp", "the CPU kernels")


@functools.cache
def extension_avx2() -> ModuleType | None:
    """The same kernels built without AVX-512 (the AVX2 `maddubs` integer path): what a CPU
    without AVX512-VNNI runs; the tests check it here too."""
    return load_extension(
        "cpu_kernels_avx2",
        "cpu_kernels.cpp",
        "the AVX2-only CPU kernels",
        ("-mno-avx512f",),
    )
