"""The prefill chunks' causal attention kernel (csrc/prefill_attention.h), both builds: close to an
fp64 softmax(QK^T)V with the chunk's queries after any earlier context, rows strided as the
engine's q/k/v views are, a row's bits independent of the chunk it came in, and bad shapes
refused with an error instead of a crash."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ext(kernel_build):
    return kernel_build


def _reference(q, k, v, scale):
    t, hq, _ = q.shape
    s_len, hkv, _ = k.shape
    g = hq // hkv
    ke, ve = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.double(), ke) * scale
    pos = torch.arange(t)[:, None] + (s_len - t)
    s = s.masked_fill(torch.arange(s_len)[None, :] > pos, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), ve)


# (T queries, S keys, Hq, Hkv): the default model's heads at prefill sizes, a chunk after a cached
# prefix, one query, no GQA, 8 query heads on 1 kv head, tails of every block size.
SHAPES = [(512, 512, 9, 3), (100, 300, 9, 3), (1, 5, 4, 4), (70, 70, 8, 1), (130, 200, 6, 2), (33, 97, 9, 3)]


@pytest.mark.parametrize(("t", "s", "hq", "hkv"), SHAPES)
def test_close_to_fp64(ext, t, s, hq, hkv) -> None:
    g = torch.Generator().manual_seed(t * 1000 + s)
    # q as a view into a fused qkv row, the way the model's attention hands it over.
    qkv = torch.randn(t, (hq + 2 * hkv) * 64, generator=g)
    q = qkv[:, : hq * 64].view(t, hq, 64)
    k, v = torch.randn(s, hkv, 64, generator=g), 3 * torch.randn(s, hkv, 64, generator=g)
    out = torch.empty(t, hq, 64)
    ext.prefill_attention(q, k, v, out, 0.125)
    assert (out.double() - _reference(q, k, v, 0.125)).abs().max().item() < 1e-5


def test_rows_do_not_depend_on_the_chunk(ext) -> None:
    q, k, v = torch.randn(300, 9, 64), torch.randn(300, 3, 64), torch.randn(300, 3, 64)
    whole = torch.empty_like(q)
    ext.prefill_attention(q, k, v, whole, 0.125)
    first = torch.empty(100, 9, 64)
    ext.prefill_attention(q[:100].contiguous(), k[:100], v[:100], first, 0.125)
    assert torch.equal(first, whole[:100])
    # The last 50 queries as a chunk after a 250-token prefix: the same rows, bit for bit.
    tail = torch.empty(50, 9, 64)
    ext.prefill_attention(q[250:].contiguous(), k, v, tail, 0.125)
    assert torch.equal(tail, whole[250:])


def test_bad_shapes_raise(ext) -> None:
    q, k, v = torch.randn(8, 4, 64), torch.randn(8, 2, 64), torch.randn(8, 2, 64)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="head size 64"):
        ext.prefill_attention(torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32),
                              torch.empty(8, 4, 32), 0.1)  # fmt: skip
    with pytest.raises(RuntimeError, match="S >= T"):
        ext.prefill_attention(q, k[:4], v[:4], out, 0.1)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.prefill_attention(q.double(), k.double(), v.double(), out.double(), 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, 0.1)
