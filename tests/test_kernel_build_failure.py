"""Where the CPU kernels cannot be built, the engine still serves (the PyTorch path, same
outputs) and says so as a warning: a failed build once made every benchmark ~3x slower with
nothing but one stderr line to show for it. The failure is real: a fresh kernel cache, no
install-time build and a compiler that always fails.

An install-time build is loaded only where its key (flags, CPU flags, torch, source text) is the
one this process would compile; otherwise the first-use build runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TinySpec, write_gguf

from inferd.kernels import build

SCRIPT = """
import sys
from inferd import LLM, SamplingParams
llm = LLM(model=sys.argv[1], verbose=False)
out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids))
"""

needs_avx2 = pytest.mark.skipif(not build.cpu_supports_avx2_fma(),
                                reason="the kernels are never built here")  # fmt: skip


def _no_compiler_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "INFERD_KERNEL_CACHE_DIR": str(tmp_path / "kernels"), "CXX": "/bin/false",
            **extra}  # fmt: skip


@needs_avx2
def test_engine_warns_when_the_kernels_fail_to_build(tmp_path) -> None:
    tiny = write_gguf(tmp_path / "tiny.gguf", TinySpec())
    env = _no_compiler_env(tmp_path, INFERD_INSTALLED_KERNELS="0")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny.path)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "tokens 4" in run.stdout
    assert "cannot build the CPU kernels" in run.stderr
    assert "CPU kernels are not loaded" in run.stderr


LOAD = """
import sys, torch
import inferd.kernels
from inferd.kernels.build import load_extension
from inferd.quantization.fp8_scales import group_scales
inferd.kernels.__path__.append(sys.argv[1])  # where the "installed" build lies
ext = load_extension("fp8_scales", "fp8_scales.cpp", "the fp8 kernel", tuple(sys.argv[2:]))
print("module", ext.__name__ if ext is not None else None)
if ext is not None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    c = torch.tensor([2.0 ** (j / 4) for j in range(4)])
    same = torch.equal(ext.fp8_group_scales(w, 32, c), group_scales(w, 32, 4, use_kernel=False))
    print("same as the PyTorch path", same)
"""


@needs_avx2
def test_an_install_time_build_loads_only_where_its_key_matches(tmp_path) -> None:
    """A kernel compiled under its install-time name (as setup.py names it) is imported without
    a compiler; other flags, or INFERD_INSTALLED_KERNELS=0, go to the first-use build instead."""
    from torch.utils import cpp_extension

    kernel = build.Kernel("fp8_scales", "fp8_scales.cpp")
    name = build.installed_module_name(kernel)
    installed = tmp_path / "installed"
    installed.mkdir()
    cpp_extension.load(name=name, sources=[str(build.CSRC / kernel.source)],
                       build_directory=str(installed), extra_cflags=kernel.cflags,
                       extra_ldflags=build.LDFLAGS)  # fmt: skip

    def load(*extra_cflags: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", LOAD, str(installed), *extra_cflags],
                              env=_no_compiler_env(tmp_path, **env), capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    run = load()
    assert run.returncode == 0, run.stderr
    assert f"module inferd.kernels.{name}" in run.stdout
    assert "same as the PyTorch path True" in run.stdout
    assert "compiling" not in run.stderr and "cannot build" not in run.stderr
    for run in (load("-DINFERD_OTHER_FLAGS"), load(INFERD_INSTALLED_KERNELS="0")):
        assert run.returncode == 0, run.stderr
        assert "module None" in run.stdout
        assert "compiling the fp8 kernel" in run.stderr
        assert "cannot build the fp8 kernel" in run.stderr


@needs_avx2
def test_a_build_killed_midway_does_not_block_the_next_load(tmp_path) -> None:
    """A first-use build killed while it compiles (Ctrl-C, OOM, a timeout) leaves torch's `lock`
    file behind; the next process builds and loads the kernel instead of waiting on it forever."""
    import signal
    import time

    env = {**os.environ, "INFERD_KERNEL_CACHE_DIR": str(tmp_path / "kernels"),
           "INFERD_INSTALLED_KERNELS": "0"}  # fmt: skip
    argv = [sys.executable, "-c", LOAD, str(tmp_path)]
    first = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((tmp_path / "kernels").rglob("lock")) and time.monotonic() < deadline:
        assert first.poll() is None, "the first build ended before it took torch's lock"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the builder and its compiler, as a kill -9 would
    first.wait()
    assert list((tmp_path / "kernels").rglob("lock")), "the killed build left no lock to recover"
    run = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "module inferd_fp8_scales" in run.stdout
    assert "same as the PyTorch path True" in run.stdout
