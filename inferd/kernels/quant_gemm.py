"""JIT build and cache of the fused dequantise-dot CPU kernels (csrc/quant_gemm.cpp).

The extension is compiled once per torch version into the inferd cache folder and loaded from
there on later starts (~0.1 s). Where it cannot be built (no compiler, not x86 with AVX2/FMA),
`extension()` returns None after one line on stderr and callers use the PyTorch fallback.
"""

from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).parent / "csrc" / "quant_gemm.cpp"


def _cpu_supports_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


def build_dir() -> Path:
    from inferd.loader.default_model import cache_dir

    tag = torch.__version__.replace("+", "_")
    path = cache_dir() / "kernels" / f"quant_gemm-torch{tag}-py{sys.version_info[0]}{sys.version_info[1]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, or None (with one line on stderr saying why) when unavailable."""
    if not _cpu_supports_avx2_fma():
        print("inferd: CPU lacks AVX2/FMA/F16C; quantized layers use the PyTorch fallback",
              file=sys.stderr, flush=True)  # fmt: skip
        return None
    from torch.utils import cpp_extension

    directory = build_dir()
    if not any(directory.glob("*.so")):
        print("inferd: compiling quantized CPU kernels (once, ~1 min) into " + str(directory),
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        return cpp_extension.load(
            name="inferd_quant_gemm",
            sources=[str(_SOURCE)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 — no compiler / ninja, or the build failed: stay correct, run slower
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"inferd: cannot build quantized CPU kernels ({first}); using the slower PyTorch "
              "fallback", file=sys.stderr, flush=True)  # fmt: skip
        return None
