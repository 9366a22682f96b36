"""Build-once-and-cache for inferd's C++ CPU kernels (PyTorch extension API, JIT on first use).

Each extension is compiled into the inferd cache folder, per torch and Python version, and loaded
from there on later starts. Where it cannot be built (no compiler, no AVX2/FMA), `load_extension`
returns None after one line on stderr, and callers keep a PyTorch path that gives the same results.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
# AVX2/FMA/F16C is the floor; -march=native adds what this CPU has (AVX512-VNNI: one instruction
# per 32 int8 multiply-adds in int8_dot.h), as llama.cpp's default native build does. The cache key
# holds the CPU's flags, so a cache folder shared with another CPU never loads a build it cannot run.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-march=native", "-fopenmp"]


def cpu_supports_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


def _cpuinfo_field(name: str) -> str:
    """The first `name : value` line's value in /proc/cpuinfo; "" where there is none."""
    try:
        m = re.search(rf"^{name}\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return ""
    return m.group(1).strip() if m else ""


def cpu_flags() -> str:
    return " ".join(sorted(_cpuinfo_field("flags").split()))


def cpu_vendor() -> str:
    """vendor_id: GenuineIntel, AuthenticAMD, ...; "" where there is none."""
    return _cpuinfo_field("vendor_id")


def _source_text(path: Path) -> bytes:
    """The source and every local header it includes, recursively (the csrc convention)."""
    seen: set[Path] = set()

    def text_of(p: Path) -> bytes:
        if p in seen:
            return b""
        seen.add(p)
        text = p.read_bytes()
        for inc in re.findall(rb'^#include "([^"]+)"', text, re.MULTILINE):
            text += text_of(p.parent / inc.decode())
        return text

    return text_of(path)


def build_dir(name: str, source: str, cflags: list[str] = CFLAGS) -> Path:
    """`$INFERD_KERNEL_CACHE_DIR` or `<inferd cache>/kernels`, one folder per kernel, source file
    (path and text) and version: checkouts sharing the cache (git worktrees, branches) would
    otherwise rebuild over each other, and a process could import another checkout's build."""
    from inferd.loader.default_model import cache_dir

    root = os.environ.get("INFERD_KERNEL_CACHE_DIR")
    tag = torch.__version__.replace("+", "_")
    path = CSRC / source
    key = f"{path}\0{' '.join(cflags)}\0{cpu_flags()}\0".encode() + _source_text(path)
    digest = hashlib.sha256(key).hexdigest()[:12]
    base = Path(root) if root else cache_dir() / "kernels"
    folder = base / f"{name}-{digest}-torch{tag}-py{sys.version_info[0]}{sys.version_info[1]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_extension(name: str, source: str, what: str, extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """Compile (once) and import csrc/`source` as module `inferd_{name}`; None if impossible.
    `extra_cflags` go after the defaults (e.g. "-mno-avx512f" builds the AVX2-only variant)."""
    if not cpu_supports_avx2_fma():
        print(f"inferd: CPU lacks AVX2/FMA/F16C; {what} use the PyTorch path", file=sys.stderr, flush=True)
        return None
    from torch.utils import cpp_extension

    cflags = CFLAGS + list(extra_cflags)
    directory = build_dir(name, source, cflags)
    if not any(directory.glob("*.so")):
        print(f"inferd: compiling {what} (once) into {directory}", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(
            name=f"inferd_{name}",
            sources=[str(CSRC / source)],
            build_directory=str(directory),
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler / ninja, or the build failed: stay correct, run slower
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"inferd: cannot build {what} ({first}); using the PyTorch path", file=sys.stderr, flush=True)
        return None
