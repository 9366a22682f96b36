"""Paged attention over a ragged batch: new K/V go into the block pool through a slot mapping,
attention reads every sequence's context back through its block table.

Three shapes cover every scheduler choice, each sequence's by its own query length only (with int8
activations, a path that depended on the rest of the step would make its tokens depend on it too):
- the kernel group: decodes and speculative verification (<= 9 query rows, the model runner's
  KERNEL_MAX_QUERY) go to the C++ paged kernel, which reads K/V in place, one sequence per task;
- a padded group: other short queries (short prompts and prefill chunks; every short query where
  the kernel cannot be built) run as ONE attention call: queries padded to [B, Hq, Qmax, D], keys gathered from their blocks to
  [B, Hkv, L, D], one mask [B, 1, Qmax, L] that is causal, shifted by each sequence's context, and
  cut at its length. Per-sequence Python work would otherwise dominate steps of many short prompts.
- long prefill chunks run one sequence at a time (padding them would waste more than it saves):
  with no earlier context, keys come straight from the chunk under a plain causal mask; otherwise
  from the cache under the shifted causal mask (chunked prefill, prefix-cache hits, recomputation).
The masks and index tensors are built once per step (`AttentionMetadata`) and shared by all layers.

A quantized cache (`--kv-cache-dtype int8|fp8`, inferd/kv/kv_cache.py) arrives as `QuantizedKV`:
K/V are quantized as they are written and dequantized as they are read (the C++ kernel reads the
codes in place). A float16 / bfloat16 cache is a plain tensor narrower than the queries: K/V are
rounded as written and widened as read. Either way a chunk without earlier context attends to its
own K/V *as stored*, so every path sees the same values whatever the chunking.

When every sequence of a padded group starts with the same cached blocks (prefix-cache hits: one
system prompt, a shared document), the group runs as cascade attention (`SharedPrefix`): the shared
keys are attended once for all queries, each sequence's own keys in a small padded call, and the two
partial softmaxes merge exactly through their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.kv.kv_cache import LayerKV, QuantizedKV


@dataclass(slots=True)
class PrefillSlice:
    start: int  # [start, end) rows of the flat token batch
    end: int
    context_len: int  # tokens in the cache after this step, including this chunk
    block_table: torch.Tensor  # [num_blocks_for_context] int64
    # [q_len, context_len] bool (True = may attend); None when the chunk has no earlier context,
    # in which case keys come straight from this chunk with a plain causal mask.
    mask: torch.Tensor | None


@dataclass(slots=True)
class SharedPrefix:
    """Leading blocks that every sequence of a padded group shares, all before any of its queries.

    Key positions [0, P * block_size) come from `blocks` for everyone; a sequence's keys from
    P * block_size on come from its row of `rest_tables`. Gathering the shared keys once instead of
    once per sequence, and scoring all queries against them in one mask-free call (one large matrix
    product instead of B small ones), is what the split saves."""

    blocks: torch.Tensor  # [P] int64
    rest_tables: torch.Tensor  # [B, R] int64 (padding points at block 0, masked)
    # [B, 1, q_max, R * block_size] float: 0 where query i of sequence b may see rest key j, -inf
    # elsewhere. Padded query rows (i >= q_len) see rest key 0 at least (never an all -inf row,
    # whose softmax is NaN); their output is dropped.
    mask: torch.Tensor


# Cascade only pays when the shared part is long enough to outweigh a second attention call.
CASCADE_MIN_SHARED_TOKENS = 128
# The exact split needs each part's log-sum-exp: PyTorch's CPU flash kernel returns it.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def shared_prefix(
    seqs: list[tuple[int, int, list[int]]], q_max: int, block_size: int, device: torch.device
) -> SharedPrefix | None:
    """The cascade plan for a padded group of (q_len, context after the step, block table), or None
    when its sequences share too little (or the device has no LSE-returning attention kernel)."""
    if len(seqs) < 2 or device.type != "cpu" or _FLASH_CPU is None:
        return None
    first = seqs[0][2]
    # Only blocks wholly before every sequence's first query: those hold no key written this step.
    shared = min((ctx - n) // block_size for n, ctx, _ in seqs)
    for _, _, table in seqs[1:]:
        k = 0
        while k < shared and table[k] == first[k]:
            k += 1
        shared = k
    if shared * block_size < CASCADE_MIN_SHARED_TOKENS:
        return None
    rest = [table[shared:] for _, _, table in seqs]
    width = max(len(t) for t in rest)
    padded = [t + [0] * (width - len(t)) for t in rest]
    tables = torch.tensor(padded, dtype=torch.long, device=device)
    q_len = torch.tensor([n for n, _, _ in seqs], device=device).view(-1, 1, 1)
    ctx = torch.tensor([c for _, c, _ in seqs], device=device).view(-1, 1, 1)
    i = torch.arange(q_max, device=device).view(1, -1, 1)
    j = torch.arange(width * block_size, device=device).view(1, 1, -1)
    # Query i sits at position ctx - q_len + i; rest key j at shared * block_size + j.
    visible = (j + shared * block_size <= ctx - q_len + i) | ((i >= q_len) & (j == 0))
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    first_blocks = torch.tensor(first[:shared], dtype=torch.long, device=device)
    return SharedPrefix(blocks=first_blocks, rest_tables=tables, mask=mask.unsqueeze(1))


@dataclass(slots=True)
class PaddedGroup:
    """Sequences attended in one call. Query row i of sequence b sits at padded position
    b * q_max + i; `padded_index[k]` is where flat-batch row `token_rows[k]` goes."""

    token_rows: torch.Tensor  # [N] int64 rows of the flat batch
    padded_index: torch.Tensor  # [N] int64 positions in the [B * q_max] padded layout
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding points at block 0, masked)
    mask: torch.Tensor | None  # [B, 1, q_max, max_blocks * block_size] bool (SDPA path only)
    q_max: int
    is_whole_batch: bool  # rows are exactly 0..T-1 in padded order (pure decode): no scatter
    # For the C++ kernel (reads K/V in place; None: use the gather + SDPA path):
    kernel: ModuleType | None = None
    row_start: torch.Tensor | None = None  # [B] first flat row of each sequence
    q_lens: torch.Tensor | None = None  # [B]
    ctx_lens: torch.Tensor | None = None  # [B] tokens in the cache after this step
    shared: SharedPrefix | None = None  # cascade attention plan (SDPA path only)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    block_size: int
    group: PaddedGroup | None  # the padded SDPA group (cascade attention when a prefix is shared)
    prefills: list[PrefillSlice]
    # Sequences whose queries the C++ kernel takes (decodes, 1 + k verification rows): chosen by
    # each sequence's own query length, so its path never depends on the rest of the step.
    kernel_group: PaddedGroup | None = None
    # Rows whose K/V also go to a second slot: the keys a draft-tree leaf's scratch block repeats
    # (inferd/engine/model_runner.py). None when the step has no leaves.
    mirror_rows: torch.Tensor | None = None
    mirror_slots: torch.Tensor | None = None


def _gather(cache: LayerKV, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [n] of one layer's K or V → [n, block_size, kv_heads, D] (index_select: far cheaper
    than 2-D advanced indexing)."""
    if isinstance(cache, QuantizedKV):
        return cache.gather(blocks, dtype)
    return cache.index_select(0, blocks).to(dtype)


def _cascade_attention(q, k_cache, v_cache, g: PaddedGroup, scale: float) -> torch.Tensor:
    """The padded group's attention split at its shared prefix; returns [N, Hq, D] for its rows.
    (The flash kernel maps query heads onto their kv head itself: no repeated K/V.)"""
    sp = g.shared
    _, block_size, n_kv, d = k_cache.shape
    n_heads = q.shape[1]
    b, width = sp.rest_tables.shape
    rows = q if g.is_whole_batch else q.index_select(0, g.token_rows)  # [N, Hq, D]
    # 1) Every query against the shared keys: one copy of them, one call, no mask.
    kp = _gather(k_cache, sp.blocks, q.dtype).view(1, -1, n_kv, d).transpose(1, 2)  # [1, Hkv, S, D]
    vp = _gather(v_cache, sp.blocks, q.dtype).view(1, -1, n_kv, d).transpose(1, 2)
    o1, lse1 = _FLASH_CPU(rows.transpose(0, 1).unsqueeze(0), kp, vp, scale=scale)
    # 2) Each sequence's queries against its own later keys, padded to [B, Hq, q_max, D] (no
    # padding when every sequence has q_max queries: the padded layout is then the rows' own).
    uniform = rows.shape[0] == b * g.q_max
    qs = rows
    if not uniform:
        qs = rows.new_zeros(b * g.q_max, n_heads, d).index_copy_(0, g.padded_index, rows)
    qs = qs.view(b, g.q_max, n_heads, d).transpose(1, 2)
    flat = sp.rest_tables.view(-1)
    ks = _gather(k_cache, flat, q.dtype).view(b, width * block_size, n_kv, d).transpose(1, 2)
    vs = _gather(v_cache, flat, q.dtype).view(b, width * block_size, n_kv, d).transpose(1, 2)
    o2, lse2 = _FLASH_CPU(qs, ks, vs, attn_mask=sp.mask, scale=scale)
    o2 = o2.transpose(1, 2).reshape(b * g.q_max, n_heads, d)
    lse2 = lse2.transpose(1, 2).reshape(b * g.q_max, n_heads)
    if not uniform:
        o2, lse2 = o2.index_select(0, g.padded_index), lse2.index_select(0, g.padded_index)
    # 3) Exact merge: the softmax over both key sets weighs each part by its share of the mass,
    # exp(lse1) / (exp(lse1) + exp(lse2)) = sigmoid(lse1 - lse2) for the shared part.
    o1, lse1 = o1[0].transpose(0, 1), lse1[0].transpose(0, 1)  # [N, Hq, D], [N, Hq]
    return torch.lerp(o2, o1, torch.sigmoid(lse1 - lse2).unsqueeze(-1).to(o1.dtype))


def _padded_group_attention(q, k_cache, v_cache, g: PaddedGroup, scale: float, gqa: bool):
    if g.shared is not None:
        return _cascade_attention(q, k_cache, v_cache, g, scale)
    _, block_size, n_kv, d = k_cache.shape
    b, max_blocks = g.block_tables.shape
    flat = g.block_tables.view(-1)
    keys = _gather(k_cache, flat, q.dtype).view(b, max_blocks * block_size, n_kv, d).transpose(1, 2)
    vals = _gather(v_cache, flat, q.dtype).view(b, max_blocks * block_size, n_kv, d).transpose(1, 2)
    n_heads = q.shape[1]
    if g.is_whole_batch:
        qp = q
    else:
        qp = q.new_zeros(b * g.q_max, n_heads, d).index_copy_(0, g.padded_index, q.index_select(0, g.token_rows))
    qp = qp.view(b, g.q_max, n_heads, d).transpose(1, 2)  # [B, Hq, Qmax, D]
    o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
    o = o.transpose(1, 2).reshape(b * g.q_max, n_heads, d)
    return o if g.is_whole_batch else o.index_select(0, g.padded_index)


def _write(cache: LayerKV, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [n, Hkv, D] into flat `slots`, as stored (quantized, or rounded to a 2-byte cache)."""
    if isinstance(cache, QuantizedKV):
        cache.write(slots, x)
    else:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: LayerKV,  # [num_blocks, block_size, Hkv, D]
    v_cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, Hq, D]."""
    _, block_size, n_kv, d = k_cache.shape
    quantized = isinstance(k_cache, QuantizedKV)
    if meta.mirror_rows is not None:  # before the writes below replace k and v by what is stored
        _write(k_cache, meta.mirror_slots, k.index_select(0, meta.mirror_rows))
        _write(v_cache, meta.mirror_slots, v.index_select(0, meta.mirror_rows))
    if quantized:
        k = k_cache.write(meta.slot_mapping, k)
        v = v_cache.write(meta.slot_mapping, v)
    else:
        if k_cache.dtype != k.dtype:  # a 2-byte cache: round once, attend to what is stored
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, v)
        k, v = k.to(q.dtype), v.to(q.dtype)
    gqa = q.shape[1] != n_kv

    out = None
    kg = meta.kernel_group
    if kg is not None:
        out = torch.empty_like(q)
        if quantized:
            kg.kernel.paged_attention_short_quant(
                q.contiguous(), k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                k_cache.fmt.kernel_code, kg.row_start, kg.q_lens, kg.ctx_lens, kg.block_tables,
                out, scale,
            )  # fmt: skip
        else:
            kg.kernel.paged_attention_short(q.contiguous(), k_cache, v_cache, kg.row_start, kg.q_lens,
                                            kg.ctx_lens, kg.block_tables, out, scale)  # fmt: skip
        if meta.group is None and not meta.prefills:
            return out
    g = meta.group
    if g is not None:
        o = _padded_group_attention(q, k_cache, v_cache, g, scale, gqa)
        if g.is_whole_batch:
            return o
        out = (torch.empty_like(q) if out is None else out).index_copy_(0, g.token_rows, o)
    elif out is None:
        out = torch.empty_like(q)

    # Long chunks: inferd's causal kernel where it runs (fp32 on the CPU, head size 64), ~2x ATen's
    # CPU flash attention, whose small gemms are MKL's; SDPA elsewhere.
    ext = cpu_kernels() if meta.prefills and q.is_cpu and q.dtype == torch.float32 and d == 64 else None
    for p in meta.prefills:
        if p.mask is None:  # no earlier context: the chunk's own keys, plain causal
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:  # after cached context: every key of the sequence, causal shifted by the context
            n = p.block_table.numel()
            kp = _gather(k_cache, p.block_table, q.dtype).view(n * block_size, n_kv, d)[: p.context_len]
            vp = _gather(v_cache, p.block_table, q.dtype).view(n * block_size, n_kv, d)[: p.context_len]
        if ext is not None:
            ext.prefill_attention(q[p.start : p.end], kp, vp, out[p.start : p.end], scale)
            continue
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
        out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
    return out
