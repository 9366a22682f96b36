"""A slow fallback path is reported once, as a warning, on any device (inferd/slow_paths.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from inferd import LLM, slow_paths
from inferd.quantization import formats


@pytest.fixture
def fresh(monkeypatch, caplog):
    monkeypatch.setattr(slow_paths, "_reported", set())
    monkeypatch.setattr(formats, "_REPORTED_DEQUANTIZE", False)
    caplog.set_level(logging.WARNING, logger="inferd.engine")
    return caplog


def test_dequantising_matmul_warns_once(fresh):
    w = formats.quantize(torch.randn(64, 64), "int8")
    x = torch.randn(2, 64, dtype=torch.bfloat16)  # no fused kernel takes bf16 input
    y = formats.quantized_matmul(x, w)
    formats.quantized_matmul(x, w)
    assert y.shape == (2, 64)
    warned = [r.getMessage() for r in fresh.records if "slow path" in r.getMessage()]
    assert len(warned) == 1 and "int8 weights on cpu bfloat16 input are dequantised" in warned[0]
    # The reference path asked for explicitly is no fallback.
    fresh.clear()
    formats._REPORTED_DEQUANTIZE = False
    slow_paths._reported.clear()
    formats.quantized_matmul(torch.randn(2, 64, dtype=torch.bfloat16), w, use_kernels=False)
    assert "slow path" not in fresh.text


def test_engine_without_a_paged_attention_kernel_warns(fresh, tiny_models):
    LLM(str(tiny_models["llama-f32.gguf"].path), dtype="bfloat16", device="cpu", verbose=False,
        kv_cache_memory=1 << 20, quantization="none")  # fmt: skip
    assert "slow path: no paged attention kernel for bfloat16 on cpu" in fresh.text
