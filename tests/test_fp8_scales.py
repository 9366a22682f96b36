"""fp8 per-group scale search (inferd/quantization/fp8_scales.py): no group is ever worse than with
absmax scaling, nothing clips, the error drops on real-looking weights, and the C++ search makes
the same choices as the PyTorch path (its E4M3 rounding equal to PyTorch's float8_e4m3fn)."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels.fp8_scales import extension
from inferd.quantization.formats import FP8_MAX, dequantize_rows, quantize_fp8, quantize_int4
from inferd.quantization.fp8_scales import group_scales


def _gaussian(n=96, k=256, seed=0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _weights() -> dict[str, torch.Tensor]:
    g = _gaussian()
    heavy = _gaussian(seed=1) ** 3  # heavy tails: one big weight per group, the rest tiny
    lattice = dequantize_rows(quantize_int4(_gaussian(seed=2)))  # like GGUF Q4_1 dequantised
    tiny = _gaussian(seed=3) * 1e-30  # scales clamp at 1e-12: E4M3 subnormals and zeros
    mixed = g.clone()
    mixed[:8] = 0.0  # all-zero groups
    mixed[8:16, ::7] = 3.0  # outliers
    return {"gaussian": g, "heavy": heavy, "lattice": lattice, "tiny": tiny, "mixed": mixed}


def _group_sq_error(w: torch.Tensor, steps: int, group: int = 32) -> torch.Tensor:
    """[N, K / group] squared error of w's fp8 quantization with `steps` candidate scales."""
    err = (dequantize_rows(quantize_fp8(w, group, steps)) - w).double() ** 2
    return err.reshape(w.shape[0], -1, group).sum(dim=2)


@pytest.mark.parametrize("name", list(_weights()))
@pytest.mark.parametrize("group", [32, 128])
def test_search_never_worse_than_absmax(name: str, group: int) -> None:
    w = _weights()[name]
    searched, absmax = _group_sq_error(w, 16, group), _group_sq_error(w, 1, group)
    # Per group, up to float summation order (the search sums in another order than this check).
    assert (searched <= absmax * (1 + 1e-5) + 1e-30).all(), (searched - absmax).max()


def test_search_cuts_the_error() -> None:
    ws = _weights()
    ratio = {n: (_group_sq_error(ws[n], 16).sum() / _group_sq_error(ws[n], 1).sum()).item()
             for n in ("gaussian", "lattice")}  # fmt: skip
    # Typically Gaussian ~0.66, int4-lattice weights ~0.51 (E4M3 codes line up with the lattice).
    assert ratio["gaussian"] < 0.8 and ratio["lattice"] < 0.7, ratio


@pytest.mark.parametrize("name", list(_weights()))
def test_scales_only_grow_so_nothing_clips(name: str) -> None:
    w = _weights()[name]
    s = group_scales(w, 32)
    absmax = w.reshape(w.shape[0], -1, 32).abs().amax(dim=2)
    base = (absmax / FP8_MAX).clamp_min(1e-12)
    assert (s >= base).all() and (s < 2 * base).all()
    assert (absmax / s <= FP8_MAX * (1 + 2**-23)).all()  # absmax itself may land an ulp above 448


def test_per_channel_and_steps_one_is_absmax() -> None:
    w = _weights()["mixed"]
    want = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    assert torch.equal(quantize_fp8(w, None, steps=1).scales, want)
    assert quantize_fp8(w).group == w.shape[1]  # group None: per channel, searched too
    assert (
        _group_sq_error(w, 16, w.shape[1]) <= _group_sq_error(w, 1, w.shape[1]) * (1 + 1e-5)
    ).all()


def test_bad_group_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 8 dividing K"):
        group_scales(torch.zeros(4, 96), 64)
    with pytest.raises(ValueError, match="multiple of 32 dividing K"):
        quantize_fp8(torch.zeros(4, 96), 64)


# ---- the C++ search against the PyTorch path -------------------------------------------------
@pytest.fixture(scope="module")
def ext():
    e = extension()
    if e is None:
        pytest.skip("fp8 scale kernel unavailable here (no compiler or no AVX2)")
    return e


def test_kernel_rounds_like_pytorch_e4m3(ext) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~codes.isnan()].sort().values  # every finite E4M3 value, -448..448
    mids = (codes[:-1] + codes[1:]) / 2  # ties: round to even
    near = torch.cat(
        [codes * (1 + 2**-20), codes * (1 - 2**-20), mids * (1 + 2**-20), mids * (1 - 2**-20)]
    )
    rnd = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    x = torch.cat([codes, mids, near, rnd * 100, rnd * 0.01, rnd * 1e-4]).clamp(-FP8_MAX, FP8_MAX)
    x = torch.cat([x, torch.zeros(-len(x) % 8)])  # the kernel takes multiples of 8
    assert torch.equal(ext.e4m3_round_(x.clone()), x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("name", list(_weights()))
def test_kernel_chooses_like_pytorch(ext, name: str) -> None:
    w = _weights()[name]
    fast, ref = group_scales(w, 32), group_scales(w, 32, use_kernel=False)
    # Identical but where two candidates' errors tie up to summation order; then equally good.
    assert (fast == ref).float().mean() > 0.99
    if not torch.equal(fast, ref):
        g = w.reshape(-1, 32)

        def err(s: torch.Tensor) -> torch.Tensor:
            y = (g / s.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX)
            return ((y.to(torch.float8_e4m3fn).float() * s.reshape(-1, 1) - g).double() ** 2).sum(1)

        assert torch.allclose(err(fast), err(ref), rtol=1e-5, atol=1e-30)
