"""The fast attention paths equal the gather + SDPA path on random caches of awkward shapes (GQA
groups, short multi-token queries, contexts ending mid-block, shuffled block tables): the C++
kernel, and cascade attention for groups whose sequences share leading blocks."""

from __future__ import annotations

import random

import pytest
import torch

from inferd.kernels.paged_attention import extension
from inferd.layers import attention
from inferd.layers.attention import AttentionMetadata, PaddedGroup, paged_attention, shared_prefix

CPU = torch.device("cpu")


def make_groups(shapes: list[tuple[int, int]], bs: int, perm: list[int], shared: int = 0):
    """The padded group of sequences with `shapes` — (q_len, context after the step) each — whose
    blocks are popped from `perm` (the first `shared` blocks of every table the same ones), for every
    path: (slots [T], T, SDPA group, kernel group, cascade group or None)."""
    common_blocks = [perm.pop() for _ in range(shared)]
    tables, slots, rows, start = [], [], [], 0
    for q_len, ctx in shapes:
        n_blocks = -(-ctx // bs)
        table = common_blocks[:n_blocks] + [perm.pop() for _ in range(n_blocks - shared)]
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
    plan = shared_prefix([(n, c, tab) for (n, c), tab in zip(shapes, tables)], q_max, bs, CPU)
    cascade = PaddedGroup(mask=mask, shared=plan, **common) if plan is not None else None
    return torch.tensor(slots), start, sdpa, kern, cascade


def _case(seed, hq, hkv, d, bs, shapes: list[tuple[int, int]], shared=0, dtype=torch.float32):
    """shapes: (q_len, context after the step) per sequence; the first `shared` blocks of every
    block table are the same blocks. Returns {path: output} for every path that applies."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = shared + sum(-(-ctx // bs) for _, ctx in shapes) + 3
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    slots, t, sdpa, kern, cascade = make_groups(shapes, bs, perm, shared)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    groups = {"sdpa": sdpa}
    if extension() is not None and dtype == torch.float32:
        groups["kernel"] = kern
    if cascade is not None:
        groups["cascade"] = cascade
    outs = {}
    for name, group in groups.items():
        if name == "kernel":
            meta = AttentionMetadata(slots, bs, None, [], kernel_group=group)
        else:
            meta = AttentionMetadata(slots, bs, group, [])
        outs[name] = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5)
    return outs


@pytest.mark.skipif(extension() is None, reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize(
    "hq,hkv,d,bs,shapes",
    [
        (9, 3, 64, 16, [(1, 1), (1, 17), (1, 160), (1, 33)]),  # decodes, the default model's heads
        (4, 4, 32, 8, [(3, 3), (1, 9), (5, 21), (2, 16)]),  # MHA, short chunks with context
        (8, 2, 16, 4, [(7, 7)]),  # one short prompt, GQA 4
        (6, 1, 8, 1, [(2, 5), (1, 1), (4, 4)]),  # MQA, block size 1
        # Contexts split in pieces of 256 keys and merged: a verification whose first row sees
        # nothing of the last piece (2, 257), rows ending in different pieces (9, 300), exact
        # multiples (1, 256), several pieces (1, 600).
        (9, 3, 64, 16, [(1, 600), (4, 513), (9, 300), (1, 256), (2, 257)]),
    ],
)
def test_kernel_matches_sdpa(hq, hkv, d, bs, shapes):
    outs = _case(0, hq, hkv, d, bs, shapes)
    torch.testing.assert_close(outs["kernel"], outs["sdpa"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "hq,hkv,d,bs,shared,shapes",
    [
        # The benchmark's shape: 16 suffixes of 32 after a 1,024-token prefix, default model heads.
        (9, 3, 64, 16, 64, [(32, 1056)] * 16),
        # Ragged: decodes, odd chunks, suffixes ending mid-block and on block boundaries.
        (9, 3, 64, 16, 8, [(1, 129), (7, 135), (32, 160), (5, 133), (1, 200), (16, 144), (3, 131)]),
        (4, 4, 32, 8, 17, [(3, 139), (1, 137), (11, 147), (8, 152)]),  # MHA
        (8, 2, 16, 4, 33, [(7, 139), (2, 133), (1, 132)]),  # GQA 4; a query right after the prefix
        (6, 1, 8, 1, 130, [(2, 135), (1, 131), (4, 134), (1, 300)]),  # MQA, block size 1
    ],
)
def test_cascade_matches_sdpa(hq, hkv, d, bs, shared, shapes):
    outs = _case(1, hq, hkv, d, bs, shapes, shared=shared)
    assert "cascade" in outs
    torch.testing.assert_close(outs["cascade"], outs["sdpa"], rtol=1e-5, atol=1e-5)


def test_cascade_matches_sdpa_bf16():
    outs = _case(2, 9, 3, 64, 16, [(9, 150), (1, 129), (20, 170)], shared=8, dtype=torch.bfloat16)
    assert outs["cascade"].dtype == torch.bfloat16
    torch.testing.assert_close(outs["cascade"], outs["sdpa"], rtol=2e-2, atol=2e-2)


def _tables(shared: list[int], rest: list[list[int]]) -> list[list[int]]:
    return [shared + r for r in rest]


def test_shared_prefix_plan_exact_blocks_and_mask():
    bs = 16
    common = random.Random(0).sample(range(100, 200), 9)  # 144 tokens in 9 shared blocks
    tables = _tables(common, [[1, 2], [3], [4, 5, 6]])
    # (q_len, context after the step): all queries start after the 9 shared blocks.
    seqs = [(4, 9 * bs + 20, tables[0]), (1, 9 * bs + 1, tables[1]), (3, 9 * bs + 40, tables[2])]
    plan = shared_prefix(seqs, q_max=4, block_size=bs, device=CPU)
    assert plan.blocks.tolist() == common
    assert plan.rest_tables.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    visible = plan.mask[:, 0] == 0  # [B, q_max, 3 * bs]
    # Sequence 0: query i at position 144 + 16 + i sees rest keys [0, 16 + i].
    assert [int(visible[0, i].sum()) for i in range(4)] == [17, 18, 19, 20]
    assert int(visible[1, 0].sum()) == 1  # one query: the first key after the prefix
    assert [int(visible[2, i].sum()) for i in range(3)] == [38, 39, 40]
    assert visible[:, :, 0].all()  # padded rows too: no all -inf row (their output is dropped)
    assert not visible[1, :, 1 * bs :].any()  # never a padding block


def test_shared_prefix_plan_stops_where_tables_or_queries_diverge():
    bs = 16
    blocks = list(range(100, 120))
    n_min = attention.CASCADE_MIN_SHARED_TOKENS // bs
    # Tables diverge after n_min + 2 blocks.
    a, b = blocks[:12], blocks[: n_min + 2] + [7, 8, 9, 10]
    plan = shared_prefix([(1, 12 * bs, a), (1, len(b) * bs, b)], 1, bs, CPU)
    assert plan.blocks.tolist() == blocks[: n_min + 2]
    # A query inside a shared block (its key is written this step): sharing stops before it.
    plan = shared_prefix([(1, 12 * bs, a), (10, (n_min + 1) * bs + 3, a[: n_min + 2])], 10, bs, CPU)
    assert plan.blocks.tolist() == blocks[:n_min]
    # Too little shared, or one sequence only: no plan.
    short, n = blocks[: n_min - 1], (n_min - 1) * bs + 1
    assert shared_prefix([(1, n, short + [1]), (1, n, short + [2])], 1, bs, CPU) is None
    assert shared_prefix([(1, 12 * bs, a)], 1, bs, CPU) is None
    assert shared_prefix([(1, 12 * bs, a), (1, 12 * bs, [0] + a[1:])], 1, bs, CPU) is None


@pytest.mark.skipif(extension() is None, reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 32)])
def test_kernel_row_bits_do_not_depend_on_the_step(hq, hkv, d):
    """A query's output is the same bits as a decode (1 row, context p + 1), as the first or the
    last row of a 3-row verification (context p + 3 or p + 1), and beside another sequence: greedy
    speculation is lossless only if verification computes what the plain decode would. The
    positions cross the 16-key blocks of the d = 64 path and its 256-key splits."""
    ext = extension()
    bs, ctx_max = 16, 320
    g = torch.Generator().manual_seed(3)
    nb = ctx_max // bs
    k_cache = torch.randn(2 * nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(2 * nb, bs, hkv, d, generator=g)
    table = torch.randperm(2 * nb, generator=g)[:nb].view(1, -1)
    other = torch.randperm(2 * nb, generator=g)[:nb].view(1, -1)
    qs = torch.randn(ctx_max, hq, d, generator=g)

    def run(rows: list[int], ctx: int, with_other: bool = False) -> torch.Tensor:
        q = qs[rows]
        tables, row_start, q_lens, ctx_lens = table, [0], [len(rows)], [ctx]
        if with_other:  # a second sequence's decode first in the batch
            q = torch.cat([qs[:1], q])
            tables = torch.cat([other, table])
            row_start, q_lens, ctx_lens = [0, 1], [1, len(rows)], [200, ctx]
        out = torch.empty_like(q)
        ext.paged_attention_short(q.contiguous(), k_cache, v_cache, torch.tensor(row_start),
                                  torch.tensor(q_lens), torch.tensor(ctx_lens), tables, out, d**-0.5)  # fmt: skip
        return out[-len(rows):]

    for p in (0, 1, 14, 15, 16, 17, 31, 100, 254, 255, 256, 257, 300, 317):
        alone = run([p], p + 1)[0]
        if p + 3 <= ctx_max:
            assert torch.equal(run([p, p + 1, p + 2], p + 3)[0], alone), p
        if p >= 2:
            assert torch.equal(run([p - 2, p - 1, p], p + 1)[2], alone), p
        assert torch.equal(run([p], p + 1, with_other=True)[0], alone), p


@pytest.mark.skipif(extension() is None, reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (5, 1)])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
def test_chunk_rows_are_their_decodes_bits(hq, hkv, cache):
    """Every row of a prefill chunk (even and odd lengths: pass 2 takes queries in pairs) is the
    bits of the same query decoded alone, for 1, 3, 4 and 5 query heads per kv head (4 heads
    leave the pairs) and plain, 2-byte and int8 caches."""
    ext = extension()
    bs, d, ctx = 16, 64, 90
    g = torch.Generator().manual_seed(5)
    nb = ctx // bs + 1
    k_f, v_f = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    table = torch.randperm(nb, generator=g).view(1, -1)
    qs = torch.randn(ctx, hq, d, generator=g)
    if cache == "int8":
        codes = [torch.randint(-127, 128, (nb, bs, hkv, d), generator=g, dtype=torch.int8).view(torch.uint8)
                 for _ in range(2)]  # fmt: skip
        scales = [torch.rand(nb, bs, hkv, generator=g) / 64 for _ in range(2)]

    def run(first: int, n: int) -> torch.Tensor:
        q = qs[first:first + n].contiguous()
        out = torch.empty_like(q)
        args = (torch.tensor([0]), torch.tensor([n]), torch.tensor([first + n]), table, out, d**-0.5)
        if cache == "int8":
            ext.paged_attention_short_quant(q, codes[0], codes[1], scales[0], scales[1], 0, *args)
        else:
            dt = getattr(torch, cache)
            ext.paged_attention_short(q, k_f.to(dt), v_f.to(dt), *args)
        return out

    for first, n in ((0, 7), (3, 8), (20, 33), (60, 30)):
        chunk = run(first, n)
        for i in range(n):
            assert torch.equal(chunk[i], run(first + i, 1)[0]), (first, n, i)


def test_backend_selection_follows_device_dtype_and_kernels():
    fp32 = attention.select_attention_backend(CPU, torch.float32, 64)
    assert fp32.name == ("cpu" if extension() is not None else "torch")
    assert fp32.kernel is extension()
    bf16 = attention.select_attention_backend(CPU, torch.bfloat16, 64)
    assert bf16.name == "torch" and bf16.kernel is None
    forced = attention.select_attention_backend(CPU, torch.float32, 64, "torch")
    assert forced.name == "torch" and forced.kernel is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.select_attention_backend(CPU, torch.float32, 64, "flash")
    with pytest.raises(ValueError, match="does not run"):
        attention.select_attention_backend(CPU, torch.bfloat16, 64, "cpu")


@pytest.mark.skipif(extension() is None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("d", [64, 32])  # the causal kernel's head size, and SDPA's for the rest
def test_long_chunks_agree_across_backends(d):
    """Two long chunks, one without earlier context (its own keys, plain causal) and one after 50
    cached tokens (keys from the cache, shifted causal): the "cpu" backend's causal kernel and
    the "torch" backend's SDPA give the same attention, and the same cache writes."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, bs = 9, 3, 16
    k_cache = torch.randn(12, bs, hkv, d, generator=g)
    v_cache = torch.randn(12, bs, hkv, d, generator=g)
    table_a, table_b = torch.tensor([3, 7, 1]), torch.tensor([9, 0, 5, 11, 2, 8])
    n_a, ctx_b, n_b = 40, 50, 35
    pos_b = torch.arange(ctx_b, ctx_b + n_b)
    slots = torch.cat([table_a[torch.arange(n_a) // bs] * bs + torch.arange(n_a) % bs,
                       table_b[pos_b // bs] * bs + pos_b % bs])  # fmt: skip
    mask_b = torch.arange(ctx_b + n_b).unsqueeze(0) <= pos_b.unsqueeze(1)
    prefills = [attention.PrefillSlice(0, n_a, n_a, table_a, None),
                attention.PrefillSlice(n_a, n_a + n_b, ctx_b + n_b, table_b, mask_b)]  # fmt: skip
    meta = AttentionMetadata(slots, bs, None, prefills)
    t = n_a + n_b
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    outs, caches = {}, {}
    for name in ("cpu", "torch"):
        backend = attention.select_attention_backend(CPU, torch.float32, d, name)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[name] = backend.forward(q, k, v, kc, vc, meta, d**-0.5)
        caches[name] = (kc, vc)
    torch.testing.assert_close(outs["cpu"], outs["torch"], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches["cpu"], caches["torch"]))


def _dense_reference(q, k_cache, v_cache, seqs, bs, scale, window, softcap):
    """Every query row against its sequence's keys gathered densely, in fp64: query at position p
    sees keys (p - window, p] (all up to p without a window), scores soft-capped first.
    `seqs`: (first row, q_len, context after the step, block table) each."""
    out = torch.empty_like(q, dtype=torch.float64)
    hq, hkv = q.shape[1], k_cache.shape[2]
    for row0, q_len, ctx, table in seqs:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        keys = k_cache.reshape(-1, hkv, q.shape[-1])[slots].double().repeat_interleave(hq // hkv, 1)
        vals = v_cache.reshape(-1, hkv, q.shape[-1])[slots].double().repeat_interleave(hq // hkv, 1)
        for i in range(q_len):
            pos = ctx - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            s = torch.einsum("hd,khd->hk", q[row0 + i].double(), keys[lo : pos + 1]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[row0 + i] = torch.einsum("hk,khd->hd", s.softmax(-1), vals[lo : pos + 1])
    return out.float()


@pytest.mark.parametrize(
    "hq,hkv,d,bs,shapes,window,softcap",
    [
        # Decodes and short chunks whose windows start mid-block, one ending in its first block.
        (9, 3, 64, 16, [(1, 40), (5, 37), (3, 9), (1, 600)], 13, None),
        (9, 3, 64, 16, [(1, 40), (5, 37), (1, 300)], None, 3.0),
        # Head sizes 128 and 256 (the fast path), GQA 4 and MQA, windows over 256-key splits:
        # splits wholly before a sequence's first window are never read.
        (8, 2, 128, 16, [(1, 700), (7, 520), (2, 257), (1, 3)], 300, 5.0),
        (4, 1, 256, 16, [(1, 1030), (4, 600), (1, 512)], 512, None),
        (2, 1, 256, 8, [(9, 9), (3, 70)], 4, 2.0),
        (6, 1, 8, 1, [(2, 5), (1, 1), (4, 30)], 2, 1.5),  # a window of 2 keys, block size 1
        (14, 2, 64, 16, [(1, 90), (3, 61)], 20, None),  # 7 query heads per kv head
    ],
)
def test_window_and_softcap_on_every_path(hq, hkv, d, bs, shapes, window, softcap):
    """The C++ kernel and the torch backend's padded call honour a layer's window and
    soft-capping: both equal a dense fp64 reference."""
    g = torch.Generator().manual_seed(7)
    num_blocks = sum(-(-ctx // bs) for _, ctx in shapes) + 3
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    slots, t, sdpa, kern, _ = make_groups(shapes, bs, perm)
    sdpa.q_lens, sdpa.ctx_lens = kern.q_lens, kern.ctx_lens
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    seqs = [(int(r), n, c, tab) for r, (n, c), tab in
            zip(kern.row_start, shapes, [row.tolist() for row in kern.block_tables])]  # fmt: skip
    scale = d**-0.5
    torch_backend = attention.select_attention_backend(CPU, torch.float32, d, "torch")
    kc, vc = k_cache.clone(), v_cache.clone()
    got = {"torch": torch_backend.forward(q, k, v, kc, vc, AttentionMetadata(slots, bs, sdpa, []),
                                          scale, window, softcap)}  # fmt: skip
    want = _dense_reference(q, kc, vc, seqs, bs, scale, window, softcap)
    if extension() is not None:
        meta = AttentionMetadata(slots, bs, None, [], kernel_group=kern)
        got["kernel"] = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale,
                                        window, softcap)  # fmt: skip
    for name, out in got.items():
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("window,softcap", [(10, None), (None, 2.5), (7, 4.0)])
def test_long_chunks_honour_window_and_softcap(window, softcap):
    """Long prefill chunks (the torch backend, and the "cpu" one without its kernel group): a
    chunk without earlier context and one after cached context, against the dense reference."""
    g = torch.Generator().manual_seed(6)
    hq, hkv, d, bs = 4, 2, 64, 16
    k_cache = torch.randn(12, bs, hkv, d, generator=g)
    v_cache = torch.randn(12, bs, hkv, d, generator=g)
    table_a, table_b = [3, 7, 1], [9, 0, 5, 11, 2, 8]
    n_a, ctx_b, n_b = 40, 50, 35
    pos_b = torch.arange(ctx_b, ctx_b + n_b)
    slots = torch.cat([torch.tensor(table_a)[torch.arange(n_a) // bs] * bs + torch.arange(n_a) % bs,
                       torch.tensor(table_b)[pos_b // bs] * bs + pos_b % bs])  # fmt: skip
    mask_b = torch.arange(ctx_b + n_b).unsqueeze(0) <= pos_b.unsqueeze(1)
    prefills = [attention.PrefillSlice(0, n_a, n_a, torch.tensor(table_a), None),
                attention.PrefillSlice(n_a, n_a + n_b, ctx_b + n_b, torch.tensor(table_b), mask_b)]  # fmt: skip
    meta = AttentionMetadata(slots, bs, None, prefills)
    q, k, v = (torch.randn(n_a + n_b, h, d, generator=g) for h in (hq, hkv, hkv))
    names = ["torch"] + (["cpu"] if extension() is not None else [])
    for name in names:
        backend = attention.select_attention_backend(CPU, torch.float32, d, name)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k, v, kc, vc, meta, d**-0.5, window, softcap)
        seqs = [(0, n_a, n_a, table_a), (n_a, n_b, ctx_b + n_b, table_b)]
        want = _dense_reference(q, kc, vc, seqs, bs, d**-0.5, window, softcap)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.skipif(extension() is None, reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_windowed_row_bits_do_not_depend_on_the_step(d):
    """With a window, a query's output is still the same bits as a decode, inside a verification,
    or beside another sequence (the splits a step reads depend on its first query)."""
    ext = extension()
    hq, hkv, bs, ctx_max, window = 4, 1, 16, 700, 300
    g = torch.Generator().manual_seed(4)
    nb = ctx_max // bs + 1
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    table = torch.randperm(nb, generator=g).view(1, -1)
    qs = torch.randn(ctx_max, hq, d, generator=g)

    def run(rows: list[int], ctx: int) -> torch.Tensor:
        q = qs[rows].contiguous()
        out = torch.empty_like(q)
        ext.paged_attention_short(q, k_cache, v_cache, torch.tensor([0]), torch.tensor([len(rows)]),
                                  torch.tensor([ctx]), table, out, d**-0.5, window, 3.0)  # fmt: skip
        return out

    for p in (0, 5, 255, 256, 299, 300, 301, 555, 556, 557, 600):
        alone = run([p], p + 1)[0]
        if p >= 60:
            assert torch.equal(run(list(range(p - 60, p + 1)), p + 1)[-1], alone), p
        if p + 3 <= ctx_max:
            assert torch.equal(run([p, p + 1, p + 2], p + 3)[0], alone), p
