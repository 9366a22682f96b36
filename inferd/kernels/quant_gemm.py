"""inferd's CPU kernels (csrc/cpu_kernels.cpp: quantized matmuls, paged attention, the decode
step's decoder layers): the build `pip install` made for this CPU and torch, else built on first
use (see build.py).

Where they cannot be built (no compiler, not x86 with AVX2/FMA), `extension()` returns None after
one line on stderr and callers use the PyTorch fallback.
"""

from __future__ import annotations

import functools
from types import ModuleType

from inferd import envs
from inferd.kernels.build import cpu_flags, cpu_vendor, load_extension

# How the kernels prefetch the weights a step streams once (csrc/stream_prefetch.h): a property
# of the CPU's caches. On AMD, fp32 weights read for several rows at once (speculative
# verification) into L2, everything else non-temporally, so the victim L3 keeps the KV cache and a
# draft head: on a Zen 4 EPYC, 2-3 verified fp32 drafts cost 0.08-0.15 of a plain step against
# 0.41-0.57 with every prefetch non-temporal (start-up calibration). On an Intel Xeon (Emerald Rapids, 2 Dec) the
# non-temporal hint halved the fp32 decode (16.7 against 31.7 tok/s with T0, 30.6 with none;
# `-q auto` 104 against 161 and 122; alternated in one process), so other vendors take T0; the L2
# hints were not measured there. `INFERD_STREAM_PREFETCH=l2-rows|l2|nta|t0|off` overrides.
STREAM_PREFETCH_HINTS = {"nta": 0, "t0": 1, "off": 2, "l2": 3, "l2-rows": 4}


def stream_prefetch_hint() -> str:
    """The hint this process uses: the environment's, else the CPU vendor's default."""
    env = envs.INFERD_STREAM_PREFETCH  # validated there against envs.STREAM_PREFETCH_CHOICES
    if env is not None:
        return env
    return "l2-rows" if cpu_vendor() == "AuthenticAMD" else "t0"


def _with_stream_prefetch(ext: ModuleType | None) -> ModuleType | None:
    if ext is not None:
        ext.set_stream_prefetch(STREAM_PREFETCH_HINTS[stream_prefetch_hint()])
    return ext


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, or None (with one line on stderr saying why) when unavailable."""
    return _with_stream_prefetch(load_extension("cpu_kernels", "cpu_kernels.cpp", "the CPU kernels"))


@functools.cache
def extension_avx2() -> ModuleType | None:
    """The same kernels built without AVX-512 (the AVX2 `maddubs` integer path): what a CPU
    without AVX512-VNNI runs; the tests check it here too. On a CPU without AVX-512 that is the
    native build itself (`-mno-avx512f` changes nothing there), which is returned instead of
    compiling the same code a second time."""
    if "avx512f" not in cpu_flags().split():
        return extension()
    return _with_stream_prefetch(
        load_extension("cpu_kernels_avx2", "cpu_kernels.cpp", "the AVX2-only CPU kernels", ("-mno-avx512f",))
    )
