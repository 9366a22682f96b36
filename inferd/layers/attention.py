"""Paged attention over a ragged batch: new K/V go into the block pool through a slot mapping,
attention reads every sequence's context back through its block table.

The batch is split in two shapes that cover every scheduler choice:
- decodes (q_len == 1) run as one padded batch: keys gathered to [B, Hkv, L, D], a length mask;
- prefill chunks (q_len > 1) run one sequence at a time with a causal mask shifted by the context
  already in the cache (chunked prefill, recomputation after preemption, speculative verification).
The masks and index tensors are built once per step (`AttentionMetadata`) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    block_size: int
    decode_rows: torch.Tensor | None  # [Bd] int64 rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int64 (padding points at block 0)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSlice]
    decode_is_whole_batch: bool = False  # every row is a decode: skip the scatter back


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, Hq, D]."""
    num_blocks, block_size, n_kv, d = k_cache.shape
    k_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != n_kv

    if meta.decode_rows is not None:
        bt = meta.decode_block_tables
        bd, max_blocks = bt.shape
        # [Bd, max_blocks, bs, Hkv, D] → [Bd, Hkv, L, D]
        flat = bt.view(-1)  # index_select: far cheaper than advanced indexing with a 2-D index
        keys = k_cache.index_select(0, flat).view(bd, max_blocks * block_size, n_kv, d).transpose(1, 2)
        vals = v_cache.index_select(0, flat).view(bd, max_blocks * block_size, n_kv, d).transpose(1, 2)
        qd = q if meta.decode_is_whole_batch else q[meta.decode_rows]
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2), keys, vals, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )  # [Bd, Hq, 1, D]
        if meta.decode_is_whole_batch:
            return o.squeeze(2)
        out[meta.decode_rows] = o.squeeze(2)

    for p in meta.prefills:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if p.mask is None:
            kp = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vp = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                               enable_gqa=gqa)  # fmt: skip
        else:
            n = p.block_table.numel()
            kp = k_cache.index_select(0, p.block_table).view(1, n * block_size, n_kv, d)[:, : p.context_len]
            vp = v_cache.index_select(0, p.block_table).view(1, n * block_size, n_kv, d)[:, : p.context_len]
            o = F.scaled_dot_product_attention(
                qp, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=p.mask, scale=scale,
                enable_gqa=gqa,
            )  # fmt: skip
        out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
    return out
