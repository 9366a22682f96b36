"""The C++ paged attention kernel equals the gather + SDPA path on random caches of awkward shapes
(GQA groups, short multi-token queries, contexts ending mid-block, shuffled block tables)."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels.paged_attention import extension
from inferd.layers.attention import AttentionMetadata, PaddedGroup, paged_attention


def make_groups(shapes: list[tuple[int, int]], bs: int, perm: list[int]):
    """The padded group of sequences with `shapes` — (q_len, context after the step) each — whose
    blocks are popped from `perm`, for both paths: (slots [T], T, SDPA group, kernel group)."""
    tables, slots, rows, start = [], [], [], 0
    for q_len, ctx in shapes:
        n_blocks = -(-ctx // bs)
        table = [perm.pop() for _ in range(n_blocks)]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - q_len, ctx)]
        rows.append(start)
        start += q_len
    width = max(len(x) for x in tables)
    padded = torch.tensor([x + [0] * (width - len(x)) for x in tables])
    q_max = max(q for q, _ in shapes)
    token_rows, padded_index = [], []
    for b, (q_len, _) in enumerate(shapes):
        token_rows += range(rows[b], rows[b] + q_len)
        padded_index += range(b * q_max, b * q_max + q_len)
    q_lens = torch.tensor([q for q, _ in shapes])
    ctxs = torch.tensor([c for _, c in shapes])
    i = torch.arange(q_max).view(1, -1, 1)
    j = torch.arange(width * bs).view(1, 1, -1)
    ql, cl = q_lens.view(-1, 1, 1), ctxs.view(-1, 1, 1)
    mask = ((j <= cl - ql + i) | ((i >= ql) & (j == 0))).unsqueeze(1)
    common = dict(token_rows=torch.tensor(token_rows), padded_index=torch.tensor(padded_index),
                  block_tables=padded, q_max=q_max, is_whole_batch=False)  # fmt: skip
    sdpa = PaddedGroup(mask=mask, **common)
    kern = PaddedGroup(mask=None, kernel=extension(), row_start=torch.tensor(rows), q_lens=q_lens,
                       ctx_lens=ctxs, **common)  # fmt: skip
    return torch.tensor(slots), start, sdpa, kern


def _case(seed: int, hq: int, hkv: int, d: int, bs: int, shapes: list[tuple[int, int]]):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    slots, t, sdpa, kern = make_groups(shapes, bs, torch.randperm(num_blocks, generator=g).tolist())
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    outs = []
    for group in (sdpa, kern):
        meta = AttentionMetadata(slots, bs, group, [])
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5))
    return outs


@pytest.mark.skipif(extension() is None, reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize(
    "hq,hkv,d,bs,shapes",
    [
        (9, 3, 64, 16, [(1, 1), (1, 17), (1, 160), (1, 33)]),  # decodes, the default model's heads
        (4, 4, 32, 8, [(3, 3), (1, 9), (5, 21), (2, 16)]),  # MHA, short chunks with context
        (8, 2, 16, 4, [(7, 7)]),  # one short prompt, GQA 4
        (6, 1, 8, 1, [(2, 5), (1, 1), (4, 4)]),  # MQA, block size 1
    ],
)
def test_kernel_matches_sdpa(hq, hkv, d, bs, shapes):
    want, got = _case(0, hq, hkv, d, bs, shapes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
