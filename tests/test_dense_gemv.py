"""The fp32 matmuls for decode-sized batches that `Linear` and the fused decode step share
(csrc/dense_gemv.h up to 8 rows, csrc/dense_gemm.h from 9 to 64): close to fp64, the same bits for
a row whatever the rows beside it within each kernel's range, bias and odd shapes handled, both
builds alike, and above 64 rows the very result of at::linear."""

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


# Row counts of the many-row kernel: one vector of rows and a part of one, several, the limit.
GEMM_ROWS = [9, 16, 17, 31, 32, 33, 48, 64]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("kernel", ["few rows", "many rows"])
def test_close_to_fp64_and_row_invariant(ext, n, k, kernel) -> None:
    few = kernel == "few rows"
    top = ext.dense_max_rows if few else ext.dense_gemm_max_rows
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
    else:  # another batch around the same row
        other = torch.randn(20, k, generator=g)
        other[7] = x[40]
        assert torch.equal(ext.dense_linear(other, w, bias)[7], y[40])


def test_rows_with_a_stride_and_no_bias(ext) -> None:
    w = torch.randn(64, 96)
    wide = torch.randn(4, 200)
    x = wide[:, 10:106]  # rows 200 floats apart, columns contiguous
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x.contiguous(), w))


def test_many_rows_with_a_stride(ext) -> None:
    w = torch.randn(70, 96)
    x = torch.randn(40, 200)[:, 10:106]
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x.contiguous(), w))


def test_more_rows_are_at_linear(ext) -> None:
    w, b = torch.randn(80, 64), torch.randn(80)
    x = torch.randn(ext.dense_gemm_max_rows + 1, 64)
    assert torch.equal(ext.dense_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_both_builds_agree() -> None:
    native, avx2 = extension(), extension_avx2()
    if native is None or avx2 is None:
        pytest.skip("CPU kernels unavailable here")
    w, x = torch.randn(333, 579), torch.randn(5, 579)
    assert torch.equal(native.dense_linear(x, w), avx2.dense_linear(x, w))
    for m in (9, 24, 64):  # the many-row kernel: 16 lanes here, 8 there, one order
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
