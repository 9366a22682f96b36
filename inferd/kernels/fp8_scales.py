"""The per-group fp8 scale search kernel (csrc/fp8_scales.cpp), built on first use (see build.py).

None where it cannot be built; inferd/quantization/fp8_scales.py then runs the same search in
PyTorch (same choices, ~12x slower).
"""

from __future__ import annotations

import functools
from types import ModuleType

from inferd.kernels.build import load_extension


@functools.cache
def extension() -> ModuleType | None:
    return load_extension("fp8_scales", "fp8_scales.cpp", "the fp8 scale search kernel")
