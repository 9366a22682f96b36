"""inferd's C++ CPU kernels: built at install time where possible, else on first use and cached.

`pip install` builds the kernels every command loads (`INSTALL_TIME`, setup.py) for the installing
machine's CPU, against the torch the package pins, into the package as `_installed_<name>_<key>`.
The key digests the flags, this CPU's feature flags, the torch version and the source text, so a
process loads an installed build only where it would have compiled the very same one: another CPU
(a wheel built elsewhere, a shared file system), another torch or edited sources find no module of
their key and compile on first use instead, into the inferd kernel cache, per source, flags, CPU,
torch and Python version. Where that fails too (no compiler, no AVX2/FMA), `load_extension` returns
None after one line on stderr, and callers keep a PyTorch path that gives the same results.

setup.py loads this file on its own, without the inferd package (whose dependencies a build
environment lacks): everything at module level needs only the standard library and torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import platform
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

CSRC = Path(__file__).parent / "csrc"
# AVX2/FMA/F16C is the floor; -march=native adds what this CPU has (AVX512-VNNI: one instruction
# per 32 int8 multiply-adds in int8_dot.h), as llama.cpp's default native build does. The cache key
# holds the CPU's flags, so a cache folder shared with another CPU never loads a build it can't run.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# What the user is told while a kernel compiles on first use: one translation unit, one core.
COMPILE_ESTIMATE = "up to 2 minutes"


class Kernel(NamedTuple):
    """One extension: csrc/`source` compiled with CFLAGS + `extra_cflags`."""

    name: str
    source: str
    extra_cflags: tuple[str, ...] = ()

    @property
    def cflags(self) -> list[str]:
        return CFLAGS + list(self.extra_cflags)


# Built by `pip install` (setup.py): the kernels `generate`, `chat` and `serve` load. The AVX2-only
# variant (tests) and the fp8 scale search (`-q fp8`) compile on first use.
INSTALL_TIME = (Kernel("cpu_kernels", "cpu_kernels.cpp"),)


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


def cpu_model() -> str:
    """model name: e.g. "AMD EPYC 7B13"; "" where there is none."""
    return _cpuinfo_field("model name")


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


def installed_module_name(kernel: Kernel) -> str:
    """The module name of `kernel`'s install-time build for this CPU, torch and source text."""
    key = f"{' '.join(kernel.cflags)}\0{cpu_flags()}\0{torch.__version__}\0".encode()
    digest = hashlib.sha256(key + _source_text(CSRC / kernel.source)).hexdigest()[:12]
    return f"_installed_{kernel.name}_{digest}"


def build_dir(name: str, source: str, cflags: list[str] = CFLAGS) -> Path:
    """`$INFERD_KERNEL_CACHE_DIR` or `<inferd cache>/kernels`, one folder per kernel, source file
    (path and text) and version: checkouts sharing the cache (git worktrees, branches) would
    otherwise rebuild over each other, and a process could import another checkout's build."""
    from inferd import envs

    tag = torch.__version__.replace("+", "_")
    path = CSRC / source
    key = f"{path}\0{' '.join(cflags)}\0{cpu_flags()}\0".encode() + _source_text(path)
    digest = hashlib.sha256(key).hexdigest()[:12]
    from inferd.private_dir import private_dir

    # Native code the process loads: the folders are 0700 and refused if others may write them.
    base = private_dir(envs.INFERD_KERNEL_CACHE_DIR)
    return private_dir(base / f"{name}-{digest}-torch{tag}-py{sys.version_info[0]}{sys.version_info[1]}")


def _say(message: str) -> None:
    print(f"inferd: {message}", file=sys.stderr, flush=True)


def _load_installed(kernel: Kernel, what: str) -> ModuleType | None:
    """The install-time build of `kernel` for this CPU, torch and source; None where there is
    none (or INFERD_INSTALLED_KERNELS=0), or it cannot be imported (said on stderr)."""
    from inferd import envs

    if not envs.INFERD_INSTALLED_KERNELS:
        return None
    module = f"inferd.kernels.{installed_module_name(kernel)}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None
    except ImportError as e:  # present but unloadable (e.g. a torch it was not built against)
        _say(f"cannot import the installed build of {what} ({e}); compiling it instead")
        return None


class _Progress:
    """While a first-use compile runs: on a terminal, the seconds elapsed, rewritten in place;
    in a log, one line when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.monotonic()
        self.done = threading.Event()
        self.tty = sys.stderr.isatty()
        self.thread = threading.Thread(target=self._tick, daemon=True) if self.tty else None

    def __enter__(self) -> _Progress:
        if self.thread is not None:
            self.thread.start()
        return self

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            elapsed = time.monotonic() - self.start
            sys.stderr.write(f"\rinferd: compiling {self.what}: {elapsed:.0f} s")
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
            sys.stderr.write("\r\033[K")
        if exc[0] is None:
            _say(f"compiled {self.what} in {time.monotonic() - self.start:.0f} s")


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build per folder at a time, across processes, and no wait on a dead builder.

    torch's own guard is a `lock` file that a killed build (Ctrl-C, OOM, a timeout) leaves behind,
    after which every later load waits for it forever. An flock is released by the kernel when its
    holder dies, so while we hold it no live process is building here and a `lock` file is stale."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "inferd-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension(
    name: str, source: str, what: str, extra_cflags: tuple[str, ...] = ()
) -> ModuleType | None:
    """The kernels of csrc/`source`: the install-time build where one matches this CPU, torch and
    source, else compiled (once) and imported as module `inferd_{name}`; None if impossible.
    `extra_cflags` go after the defaults (e.g. "-mno-avx512f" builds the AVX2-only variant)."""
    if not cpu_supports_avx2_fma():
        _say(f"CPU lacks AVX2/FMA/F16C; {what} use the PyTorch path")
        return None
    kernel = Kernel(name, source, tuple(extra_cflags))
    installed = _load_installed(kernel, what)
    if installed is not None:
        return installed
    from torch.utils import cpp_extension

    directory = build_dir(name, source, kernel.cflags)
    fresh = not any(directory.glob("*.so"))
    if fresh:
        why = " (no install-time build for this CPU and torch)" if kernel in INSTALL_TIME else ""
        _say(f"compiling {what}{why}, once, {COMPILE_ESTIMATE}, into {directory}")
    try:
        with _build_lock(directory), _Progress(what) if fresh else nullcontext():
            return cpp_extension.load(
                name=f"inferd_{name}",
                sources=[str(CSRC / source)],
                build_directory=str(directory),
                extra_cflags=kernel.cflags,
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except Exception as e:  # no compiler / ninja, or the build failed: stay correct, run slower
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _say(f"cannot build {what} ({first}); using the PyTorch path")
        return None
