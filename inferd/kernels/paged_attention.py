"""The C++ paged attention for short queries (csrc/paged_attention.cpp), built on first use."""

from __future__ import annotations

import functools
from types import ModuleType

from inferd.kernels.build import load_extension


@functools.cache
def extension() -> ModuleType | None:
    return load_extension("paged_attention", "paged_attention.cpp", "the paged attention CPU kernel")
