"""fp32 `Linear` without the engine's C++ kernels: oneDNN from a packed weight — close to fp64, a
row's bits independent of the rows beside it, the pack remade when the weight changes, and
`INFERD_ONEDNN_LINEAR=0` back on at::linear. With the kernels, `Linear` never packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels.quant_gemm import extension
from inferd.layers import onednn_linear
from inferd.layers.linear import Linear, OneDnnLinear

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="no oneDNN in this PyTorch build")


def _linear(n: int, k: int, bias: bool, seed: int, backend=OneDnnLinear) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    if backend is not None:  # as select_linear_backend would choose on a machine without kernels
        lin.backend = backend()
        lin._forward = lin.backend.forward
    lin.weight.data = torch.randn(n, k, generator=g)
    if bias:
        lin.bias.data = torch.randn(n, generator=g)
    return lin


@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, True), (37, 77, True)])
def test_many_rows_close_to_fp64_and_row_invariant(n: int, k: int, bias: bool) -> None:
    lin = _linear(n, k, bias, seed=n + k)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert lin._packed is not None and lin._packed.packed is not None  # oneDNN took the call
    ref = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
    assert (y.double() - ref).abs().max().item() < 1e-4 * k**0.5
    for m in (65, 100, 128, 299):  # a prefill chunk of any length: the same bits per row
        assert torch.equal(lin(x[:m]), y[:m]), m
    other = torch.randn(90, k)
    other[50] = x[200]
    assert torch.equal(lin(other)[50], y[200])
    # Leading dimensions are kept, as F.linear does.
    assert torch.equal(lin(x[:120].view(2, 60, k)), y[:120].view(2, 60, n))


def test_pack_follows_the_weight() -> None:
    lin = _linear(64, 48, False, seed=3)
    x = torch.randn(100, 48)
    first = lin(x)
    lin.weight.mul_(2)  # written in place (as load_weights does): the pack is stale
    torch.testing.assert_close(lin(x), 2 * first, rtol=1e-5, atol=1e-5)
    lin.weight.data = torch.randn(64, 48)  # replaced
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-4, atol=1e-4)


def test_the_engine_kernels_never_pack() -> None:
    if extension() is None:
        pytest.skip("CPU kernels unavailable here")
    lin = _linear(96, 64, False, seed=4, backend=None)
    lin(torch.randn(300, 64))
    assert lin.backend.name == "cpu-dense" and lin._packed is None


def test_turned_off_by_the_environment(monkeypatch) -> None:
    onednn_linear.available.cache_clear()
    try:
        monkeypatch.setenv("INFERD_ONEDNN_LINEAR", "0")
        assert not onednn_linear.available()
        assert not OneDnnLinear.supports(torch.empty(32, 16))  # at::linear takes those layers
    finally:
        onednn_linear.available.cache_clear()
