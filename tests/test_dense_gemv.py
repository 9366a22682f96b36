"""The fp32 matmuls that `Linear` and the fused decode step share (csrc/dense_gemv.h: a streaming
kernel up to 8 rows, register-blocked tiles above): close to fp64, the same bits for a row whatever
the number of rows and the rows beside it — one row alone, a decode batch, a prefill chunk of
hundreds — bias and odd shapes handled, both builds alike."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels.quant_gemm import extension, extension_avx2
from inferd.layers.linear import Linear


@pytest.fixture(scope="module")
def ext(kernel_build):
    return kernel_build


# (N, K): the default model's shapes, then tails: N not a multiple of the rows per pass, K not a
# multiple of 8.
SHAPES = [(960, 576), (576, 1536), (37, 576), (50, 77), (3, 5)]


# Row counts of the many-row kernel: a tile and a part of one, several, a prefill chunk of more
# than one block of rows (dense::kRowBlockRows = 128).
GEMM_ROWS = [9, 12, 13, 31, 64, 127, 128, 129, 300]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("kernel", ["few rows", "many rows"])
def test_close_to_fp64_and_row_invariant(ext, n, k, kernel) -> None:
    few = kernel == "few rows"
    top = ext.dense_max_rows if few else GEMM_ROWS[-1]
    g = torch.Generator().manual_seed(n * 1000 + k + top)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(top, k, generator=g)
    y = ext.dense_linear(x, w, bias)
    ref = x.double() @ w.double().T + bias.double()
    assert (y.double() - ref).abs().max().item() < 1e-4 * (k**0.5)
    # Any number of rows in the kernel's range, any row among them: the same bits.
    for m in range(1, top + 1) if few else GEMM_ROWS:
        assert torch.equal(ext.dense_linear(x[:m], w, bias), y[:m]), m
    if few:
        for i in range(top):
            assert torch.equal(ext.dense_linear(x[i : i + 1], w, bias), y[i : i + 1])
    else:  # the few-row kernel gives those rows the same bits; another batch around one row too
        for m in (1, 2, 5, 8):
            assert torch.equal(ext.dense_linear(x[:m], w, bias), y[:m]), m
        other = torch.randn(20, k, generator=g)
        other[7] = x[140]
        assert torch.equal(ext.dense_linear(other, w, bias)[7], y[140])
        assert torch.equal(ext.dense_linear(x[140:141], w, bias)[0], y[140])


def test_rows_with_a_stride_and_no_bias(ext) -> None:
    w = torch.randn(64, 96)
    wide = torch.randn(4, 200)
    x = wide[:, 10:106]  # rows 200 floats apart, columns contiguous
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x.contiguous(), w))


def test_many_rows_with_a_stride(ext) -> None:
    w = torch.randn(70, 96)
    x = torch.randn(40, 200)[:, 10:106]
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x.contiguous(), w))


def test_both_builds_agree() -> None:
    native, avx2 = extension(), extension_avx2()
    if native is None or avx2 is None:
        pytest.skip("CPU kernels unavailable here")
    if native is avx2:
        pytest.skip("no AVX-512 on this CPU: its build is the AVX2-only build")
    w, x = torch.randn(333, 579), torch.randn(5, 579)
    assert torch.equal(native.dense_linear(x, w), avx2.dense_linear(x, w))
    for m in (9, 24, 64, 200):  # the many-row tiles: 4 x 3 here, 2 x 1 there, one order
        x = torch.randn(m, 579)
        assert torch.equal(native.dense_linear(x, w), avx2.dense_linear(x, w)), m


def test_linear_layer_takes_the_kernel_for_any_leading_shape() -> None:
    if extension() is None:
        pytest.skip("CPU kernels unavailable here")
    layer = Linear(48, 24, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 3, 48)
    y = layer(x)
    assert y.shape == (2, 3, 24)
    assert torch.equal(
        y.reshape(6, 24), extension().dense_linear(x.reshape(6, 48), layer.weight, layer.bias)
    )
    assert torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
