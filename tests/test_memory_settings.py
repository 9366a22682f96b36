"""What importing inferd does to the process's memory (inferd/__init__.py): freed blocks stay in
glibc's heap, yet a large KV pool still comes zero-filled from a fresh mapping, as
engine/model_runner.allocate_kv_cache relies on (garbage there would be 0 × NaN in attention)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_large_kv_pool_is_zero_after_freed_garbage() -> None:
    # A fresh process: the pool must not reuse a freed block full of NaN (a 1 GiB mmap threshold
    # did exactly that for pools between 64 MiB and 1 GiB).
    code = textwrap.dedent(
        """
        import inferd, torch
        from inferd.config import ModelConfig
        from inferd.engine.model_runner import _LAZY_ZERO_BYTES, allocate_kv_cache
        cfg = ModelConfig("llama", 100, 64, 128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
        for mib in (100, 300):
            garbage = torch.empty(mib << 18).fill_(float("nan"))
            del garbage
        blocks = 3 * _LAZY_ZERO_BYTES // (4 * 2 * 16 * 2 * 16 * 4)  # ~3x the lazy threshold
        pool = allocate_kv_cache(cfg, blocks, 16, torch.float32, torch.device("cpu"))
        assert pool.numel() * 4 >= _LAZY_ZERO_BYTES
        print(bool((pool == 0).all()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "INFERD_MALLOPT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"
