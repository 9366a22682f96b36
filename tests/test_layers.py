"""The decode step's small layers: on fp32 CPU rows one C++ loop each (csrc/layer_ops.h), within
fp32 rounding of the plain formulas and with each row's bits independent of how many rows share the
call; elsewhere fewer PyTorch kernels giving the plain formulas' bits (the greedy-parity tests
compare whole generations; these pin each layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels.quant_gemm import extension
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

needs_kernels = pytest.mark.skipif(extension() is None, reason="the C++ kernels cannot be built here")


def _same_bits_alone(fn, x: torch.Tensor) -> None:
    """Every row of fn(x) equals fn of that row alone (the batch-invariance the engine relies on)."""
    together = fn(x)
    for r in range(x.shape[0]):
        assert torch.equal(fn(x[r : r + 1]), together[r : r + 1]), r


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_fp32_matches_torch_rms_norm(rows, eps):
    torch.manual_seed(rows)
    norm = RMSNorm(576, eps)
    norm.weight.data = torch.randn(576)
    for scale in (1e-3, 1.0, 300.0):
        x = torch.randn(rows, 576) * scale
        torch.testing.assert_close(norm(x), torch.rms_norm(x, (576,), norm.weight, eps), rtol=2e-6, atol=1e-6)
    # A column slice (not contiguous), as a fused projection's output can be.
    x = torch.randn(rows, 1152)[:, 288:864]
    torch.testing.assert_close(norm(x), torch.rms_norm(x, (576,), norm.weight, eps), rtol=2e-6, atol=1e-6)
    _same_bits_alone(norm, torch.randn(rows, 1152)[:, 288:864])


@needs_kernels
def test_silu_mul_matches_torch_and_is_row_invariant():
    torch.manual_seed(0)
    gu = torch.randn(70, 2 * 1539) * 6  # odd width: the vector loop's tail; large |gate| too
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    want = F.silu(gu[:, :1539]) * gu[:, 1539:]
    torch.testing.assert_close(extension().silu_mul(gu), want, rtol=2e-6, atol=1e-6)
    _same_bits_alone(extension().silu_mul, gu)


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
    assert got.dtype == dtype
    if dtype == torch.float32 and extension() is not None:  # the C++ loop: fp32 rounding apart
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        for r in range(t):
            assert torch.equal(apply_rotary(qk[r : r + 1], cos[r : r + 1], sin[r : r + 1]), got[r : r + 1])
    else:
        assert torch.equal(got, expected)
    assert torch.equal(qk, qkv[:, : 12 * 64].view(t, 12, 64))  # the input is left untouched


@needs_kernels
def test_add_rms_norm_is_the_add_then_the_norm():
    """The fused decode step adds each residual inside the next norm: the same bits as apart."""
    torch.manual_seed(3)
    ext, w = extension(), torch.randn(576)
    x, delta = torch.randn(5, 576), torch.randn(5, 1152)[:, 100:676]  # a strided delta too
    total, normed = ext.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, ext.rms_norm(x + delta, w, 1e-5))


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_kernel_follows_the_weight():
    """The kernel is chosen from the weight at the first call, and again after a cast; input of
    another dtype than an fp32 weight gets HF's upcasting formula."""
    torch.manual_seed(4)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    assert norm.backend is None
    x = torch.randn(3, 64)
    y = norm(x)
    assert norm.backend.name == ("cpu" if extension() is not None else "cpu-composite")
    if extension() is not None:
        assert torch.equal(y, extension().rms_norm(x, norm.weight, 1e-6))
    xb = x.bfloat16()
    assert torch.equal(norm(xb), _hf_rms_norm(xb, norm.weight, 1e-6))
    norm.to(torch.bfloat16)
    assert norm.backend is None
    assert torch.equal(norm(xb), _hf_rms_norm(xb, norm.weight, 1e-6))
    assert norm.backend.name == "upcast"


def test_linear_kernel_follows_the_weight():
    """fp32 on the CPU takes the engine's kernels (or oneDNN / at::linear without them); after a
    cast to bf16 the layer runs at::linear."""
    from inferd.layers import onednn_linear
    from inferd.layers.linear import Linear

    torch.manual_seed(5)
    lin = Linear(48, 24, bias=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(5, 48)
    y = lin(x)
    if extension() is not None:
        assert lin.backend.name == "cpu-dense"
        assert torch.equal(y, extension().dense_linear(x, lin.weight, lin.bias))
    else:
        assert lin.backend.name == ("onednn" if onednn_linear.available() else "torch")
    lin.to(torch.bfloat16)
    assert lin.backend is None
    xb = x.bfloat16()
    assert torch.equal(lin(xb), F.linear(xb, lin.weight, lin.bias))
    assert lin.backend.name == "torch"

@needs_kernels
def test_argmax_rows_is_torch_argmax():
    """The greedy pick (sampler, draft heads): torch's index in every case it defines — ties go to
    the first maximum, a NaN wins (the first one), all -inf is index 0 — at widths with and
    without a tail after the 8-lane loop, from rows with a stride."""
    from inferd.sampling.sampler import argmax_rows

    torch.manual_seed(0)
    for n in (1, 7, 8, 9, 16384, 49152 + 5):
        x = torch.randn(6, n)
        x[1] = float("-inf")
        x[2, :] = 0.5  # all tied
        if n > 3:
            x[3, n // 2] = x[3, n - 1] = x[3].max() + 1  # tie between the middle and the tail
            x[4, n - 2] = float("nan")
            x[4, 1] = float("nan")
            x[5, 0] = float("inf")
        torch.testing.assert_close(argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)
        wide = torch.randn(4, n + 10)[:, 3 : 3 + n]
        assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
        assert argmax_rows(x).dtype == torch.long
    bf = torch.randn(3, 100, dtype=torch.bfloat16)  # not fp32: torch's own
    assert torch.equal(argmax_rows(bf), bf.argmax(dim=-1))


@needs_kernels
def test_runner_ups_are_the_next_likeliest_and_their_probabilities():
    """A draft tree's ranking (csrc/sampling_ops.h runner_ups): after the argmax, the first index
    of the largest value not yet picked, twice, and the softmax probabilities of all three (the
    vectorised exp within 1e-5 of torch's softmax); widths with and without a tail, ties, a row
    of -inf but one value, rows too narrow for a pick (best again, probability 0), a NaN row
    (probabilities 0), rows with a stride."""
    from inferd.kernels.quant_gemm import extension
    from inferd.sampling.sampler import argmax_rows

    ext = extension()
    torch.manual_seed(1)
    for n in (1, 2, 7, 9, 16384, 49152 + 5):
        x = torch.randn(6, n + 4)[:, 2 : 2 + n] * 4
        if n > 3:
            x[1, n // 3] = x[1, n - 1] = x[1, 1] = x[1].max() + 1  # the best tied: the others too
            x[2] = float("-inf")
            x[2, n - 2] = 3.0  # the others all -inf: probability 1 and 0
            x[3, 0] = x[3, n // 2] = x[3].max() + 2  # the best at index 0, tied later
            x[4, 5 % n] = float("nan")
        best = argmax_rows(x)
        others, probs = ext.runner_ups(x, best, 2)
        assert others.dtype == torch.long and others.shape == (6, 2) and probs.shape == (6, 3)
        for r in range(6):
            row = x[r]
            if n > 3 and r == 4:
                assert probs[r].tolist() == [0.0, 0.0, 0.0]
                continue
            taken, want_idx = {int(best[r])}, []
            for _ in range(2):
                left = [i for i in range(n) if i not in taken]
                if left:  # the first of the largest values left
                    top = max(row[i].item() for i in left)
                    want_idx.append(next(i for i in left if row[i].item() == top))
                    taken.add(want_idx[-1])
            assert others[r, : len(want_idx)].tolist() == want_idx, (n, r)
            assert (others[r, len(want_idx) :] == best[r]).all()  # too narrow: best again
            p = row.softmax(-1)
            want = [p[best[r]].item()] + [p[i].item() for i in want_idx]
            want += [0.0] * (2 - len(want_idx))
            torch.testing.assert_close(probs[r], torch.tensor(want), rtol=1e-5, atol=1e-7)


def _kept_sets_agree(fast: torch.Tensor, slow: torch.Tensor, logits: torch.Tensor, top_k, top_p) -> None:
    """Each row keeps the same tokens with their logits (the rest -inf), except where the sorted
    path's fp32 cumulative sum and the kernel's fp64 one round to different sides of top_p: then
    only the last kept token may differ, and its mass before must be within 3e-5 of top_p."""
    for r in range(logits.shape[0]):
        a, b = torch.isfinite(fast[r]), torch.isfinite(slow[r])
        assert torch.equal(fast[r][a], logits[r][a])
        if torch.equal(a, b):
            continue
        diff = (a ^ b).nonzero().flatten()
        assert len(diff) == 1, (r, diff)
        k = int(top_k[r]) if 0 < int(top_k[r]) < logits.shape[1] else logits.shape[1]
        kept = logits[r].topk(k).values
        probs = kept.double().softmax(0)
        before = probs[kept > logits[r][diff[0]]].sum()
        # The sorted path's fp32 cumulative sum drifts from the exact one by up to ~1e-5 over
        # a long row, and how far depends on the CPU's vector width (1.06e-5 on AVX2).
        assert abs(float(before) - float(top_p[r])) < 3e-5, r


@needs_kernels
def test_top_k_top_p_kernel_keeps_what_the_sort_keeps():
    """The sampler's filter (csrc/sampling_ops.h, which orders the nucleus only) against the
    full-sort formulation, row by row: peaked and near-flat rows, -inf (masked) tokens, top-k
    alone, top-p alone, both, and neither."""
    from inferd.sampling.sampler import _filter_top_k_top_p, _filter_top_k_top_p_sorted

    torch.manual_seed(0)
    v = 5003
    rows = [torch.randn(v) * 6, torch.randn(v) * 0.05, torch.randn(v) * 2, torch.randn(v) * 12]
    rows[2][::3] = float("-inf")
    logits = torch.stack(rows * 6)  # 24 rows
    top_k = torch.tensor([0, 0, 0, 0, 1, 7, 300, v, 0, 0, 0, 0, 50, 50, 50, 50, 0, v + 9, 2, 0, 0, 0, 0, 0])
    top_p = torch.tensor([1.0, 0.95, 0.5, 0.9, 1.0, 1.0, 0.8, 0.3, 0.99, 0.7, 0.0, 0.1,
                          0.9, 0.95, 0.5, 1.0, 1.0, 0.6, 0.5, 0.999, 0.95, 0.95, 0.95, 0.95])
    fast = _filter_top_k_top_p(logits, top_k, top_p)
    nucleus = top_p < 1
    slow = _filter_top_k_top_p_sorted(logits[nucleus], top_k[nucleus], top_p[nucleus])
    _kept_sets_agree(fast[nucleus], slow, logits[nucleus], top_k[nucleus], top_p[nucleus])
    # top_p 1 keeps the whole top-k set (a sorted fp32 cumulative sum can reach 1.0 before a
    # peaked row's tail, which a cut at top_p would then drop).
    for r in (~nucleus).nonzero().flatten().tolist():
        k = int(top_k[r]) if 0 < int(top_k[r]) < v else v
        want = torch.full((v,), float("-inf"))
        idx = logits[r].topk(k).indices
        want[idx] = logits[r][idx]
        assert torch.equal(fast[r], want), r
    assert torch.equal(fast[0], logits[0]) and torch.equal(fast[16], logits[16])  # no filter
    assert int(torch.isfinite(fast[4]).sum()) == 1 and int(torch.isfinite(fast[10]).sum()) == 1
    assert int(torch.isfinite(fast[6]).sum()) <= 300
    # Rows from a real distribution's shape: 49k logits, nucleus of a few hundred.
    big = torch.randn(8, 49152) * 4
    k8, p8 = torch.zeros(8, dtype=torch.long), torch.full((8,), 0.95)
    _kept_sets_agree(_filter_top_k_top_p(big, k8, p8), _filter_top_k_top_p_sorted(big, k8, p8), big, k8, p8)
    # Flat rows (too many candidates to sort; their boundary found by value bins): a uniform row
    # keeps its lowest indices up to top_p of the mass; a near-uniform one agrees with the sort.
    flat = torch.stack([torch.zeros(49152), torch.randn(49152) * 0.3, torch.randn(49152) * 0.01])
    kf, pf = torch.zeros(3, dtype=torch.long), torch.tensor([0.95, 0.9, 0.5])
    got = _filter_top_k_top_p(flat, kf, pf)
    n = int(0.95 * 49152) + 1  # token j has j / V of the mass before it
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == list(range(n))
    _kept_sets_agree(got[1:], _filter_top_k_top_p_sorted(flat[1:], kf[1:], pf[1:]), flat[1:], kf[1:], pf[1:])


@needs_kernels
def test_draw_follows_the_distribution_and_the_seed():
    """`draw` (one uniform per row, inverse CDF in C++): the C++ walk and the cumsum/searchsorted
    fallback pick the same token for the same u; 40k draws match a distribution with a few
    zero-probability tokens (never drawn); a seeded row repeats whatever shares its batch."""
    from types import SimpleNamespace

    from inferd.sampling.sampler import draw

    ext = extension()
    torch.manual_seed(0)
    probs = torch.rand(5, 1000) ** 4
    probs[:, ::7] = 0.0
    u = torch.rand(5, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(ext.sample_rows(probs, u), want)
    assert torch.equal(ext.sample_rows(probs, torch.zeros(5, dtype=torch.float64)), (probs > 0).int().argmax(-1))

    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.0, 0.05])
    free = [SimpleNamespace(generator=None)] * 40_000
    counts = torch.bincount(draw(p.expand(len(free), -1).contiguous(), free), minlength=6).double()
    assert counts[1] == 0 and counts[4] == 0
    expected = p.double() * len(free)
    nz = expected > 0
    chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
    assert chi2 < 20.5, chi2  # 3 degrees of freedom: p < 1.4e-4 of failing by chance

    def seeded():
        return SimpleNamespace(generator=torch.Generator().manual_seed(7))

    alone = draw(probs[:1], [seeded()])
    beside = draw(probs[[2, 0, 1]], [SimpleNamespace(generator=None), seeded(), SimpleNamespace(generator=None)])
    assert alone[0] == beside[1]
