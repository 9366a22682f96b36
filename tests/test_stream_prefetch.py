"""The prefetch hint of streamed weights (csrc/stream_prefetch.h) is a run-time choice per CPU
vendor, overridable by `INFERD_STREAM_PREFETCH`: every hint gives the same bits (it is only a
hint), a bad value is refused, and a fresh process takes the environment's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inferd.kernels import build, quant_gemm


def _per_hint(ext, run) -> list:
    """`run()` under each hint in turn; the process's hint restored after."""
    before = ext.stream_prefetch()
    try:
        outs = []
        for hint in quant_gemm.STREAM_PREFETCH_HINTS.values():
            ext.set_stream_prefetch(hint)
            assert ext.stream_prefetch() == hint
            outs.append(run())
        return outs
    finally:
        ext.set_stream_prefetch(before)


def test_every_hint_gives_the_same_bits(kernel_build) -> None:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(960, 2304, generator=g), torch.randn(960, generator=g)  # rows past the 4 KB lookahead
    x = torch.randn(4, 2304, generator=g)
    outs = _per_hint(kernel_build, lambda: torch.cat([kernel_build.dense_linear(x[:1], w, b),
                                                      kernel_build.dense_linear(x, w, b)]))  # fmt: skip
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_every_hint_gives_the_same_bits_on_packed_tiles(packed_tiles_ext) -> None:
    from inferd.quantization.formats import pack_tiles, quantize_int4

    g = torch.Generator().manual_seed(4)
    tiles = pack_tiles(quantize_int4(torch.randn(512, 1536, generator=g)))
    x = torch.randn(3, 1536, generator=g)
    outs = _per_hint(packed_tiles_ext,
                     lambda: packed_tiles_ext.tiles_linear(x, tiles.data, tiles.scales, tiles.mins, True))  # fmt: skip
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_hints_are_refused(kernel_build, monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="stream prefetch hint"):
        kernel_build.set_stream_prefetch(len(quant_gemm.STREAM_PREFETCH_HINTS))
    monkeypatch.setenv("INFERD_STREAM_PREFETCH", "always")
    with pytest.raises(ValueError, match="INFERD_STREAM_PREFETCH='always'"):
        quant_gemm.stream_prefetch_hint()


def test_default_follows_the_vendor_and_the_environment_wins(monkeypatch) -> None:
    monkeypatch.delenv("INFERD_STREAM_PREFETCH", raising=False)
    amd = build.cpu_vendor() == "AuthenticAMD"
    assert quant_gemm.stream_prefetch_hint() == ("l2-rows" if amd else "t0")
    if quant_gemm.extension() is None:
        pytest.skip("CPU kernels unavailable here")
    code = "from inferd.kernels.quant_gemm import extension; print(extension().stream_prefetch())"
    for name, value in quant_gemm.STREAM_PREFETCH_HINTS.items():
        env = dict(os.environ, INFERD_STREAM_PREFETCH=name.upper())
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(value), out.stderr
