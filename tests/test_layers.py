"""The decode step's small layers, rewritten with fewer kernels, compute the same bits as the plain
formulas they replace (the greedy-parity tests compare whole generations; these pin each layer)."""

from __future__ import annotations

import pytest
import torch

from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_fp32_equals_torch_rms_norm(rows, eps):
    torch.manual_seed(rows)
    norm = RMSNorm(576, eps)
    norm.weight.data = torch.randn(576)
    for scale in (1e-3, 1.0, 300.0):
        x = torch.randn(rows, 576) * scale
        assert torch.equal(norm(x), torch.rms_norm(x, (576,), norm.weight, eps))
    # A column slice (not contiguous), as a fused projection's output can be.
    x = torch.randn(rows, 1152)[:, 288:864]
    assert torch.equal(norm(x), torch.rms_norm(x, (576,), norm.weight, eps))


def _rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + swapped * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_apply_rotary_equals_reference(dtype, t):
    torch.manual_seed(t)
    rope = RotaryEmbedding(64, 512, rope_inv_freq(64, 10000.0, None))
    cos, sin = rope(torch.tensor([3, 100, 7, 511, 0][:t]))
    # q and k heads side by side in a slice of the fused qkv output, as LlamaAttention passes them.
    qkv = torch.randn(t, 12 * 64 + 3 * 64).to(dtype)
    qk = qkv[:, : 12 * 64].view(t, 12, 64)
    expected = _rotary_reference(qk, cos, sin)
    got = apply_rotary(qk, cos, sin)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert torch.equal(qk, qkv[:, : 12 * 64].view(t, 12, 64))  # the input is left untouched
