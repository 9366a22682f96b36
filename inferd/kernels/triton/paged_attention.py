"""Paged attention for short query blocks on CUDA (Triton): decodes, 1 + k verification rows and
draft-tree leaves, reading K/V in place through block tables.

Contract: `paged_attention_short(q, k_cache, v_cache, row_start, q_lens, ctx_lens, block_tables,
out, scale, window, softcap, q_max)` fills `out` [T, Hq, D] for every query row of the entries
(sequence pieces): entry b's queries are flat rows [row_start[b], row_start[b] + q_lens[b]), they
sit at positions ctx - q_len + i and see keys [0, pos] (the last `window` only, when set) of that
entry's block table. The pool is [num_blocks, block_size, Hkv, D] of a float dtype, or `QuantizedKV`
(uint8 codes with an fp32 scale per slot and kv head, inferd/kv/kv_cache.py).

Shape of the work (flash-decoding): one program per (entry, kv head, query tile, key split). A
program takes a tile of queries times the kv head's GQA group of query heads as the rows of one
`tl.dot`, so K/V are read once per kv head, not once per query head. Keys are split into chunks of
SPLIT_KEYS: a long context spreads over many programs even at batch 1, and a second kernel merges
the splits through their log-sum-exps. The split size is fixed, and nothing about the launch
depends on ctx values (only on tensor shapes and `q_max`), so the host never reads the device.
Scores and softmax are fp32; codes of a quantized cache enter the dot as exact small floats and
their scales multiply the scores (K) and the probabilities (V) (`dot_dtypes` for the products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys one split covers: with D = 128 and bf16 K/V a split reads 256 KB, enough to hide latency.
SPLIT_KEYS = 512
# Codes of a quantized cache, as kv_cache.KVFormat.kernel_code numbers them; FLOAT: a float pool.
FLOAT, INT8, FP8_E4M3, FP8_E5M2 = -1, 0, 1, 2
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_kv(ptr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A tile of K or V as DOT_DTYPE: the float pool's values, or a quantized pool's codes (exact
    in fp16 / bf16). A pool already in DOT_DTYPE goes to the dot as loaded, so it pipelines."""
    x = tl.load(ptr)
    if FMT == 0:
        return x.to(tl.int8, bitcast=True).to(DOT_DTYPE)
    elif FMT == 1:
        return x.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    elif FMT == 2:
        return x.to(tl.float8e5, bitcast=True).to(DOT_DTYPE)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    row_start_ptr, q_len_ptr, ctx_ptr, table_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    sm_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
    num_q_tiles,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """q [T, Hq, D]; K/V pool [NB, BS, Hkv, D] and scales [NB, BS, Hkv]; row_start, q_len, ctx
    [B]; block tables [B, W]; out [T, Hq, D]; partials [T, Hq, SPLITS, D] and [T, Hq, SPLITS]."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // num_q_tiles
    q_tile = tl.program_id(1) % num_q_tiles
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * G
    # Row m of the tile: query i = q_tile * BLOCK_Q + m // G, head kvh * G + m % G.
    m = tl.arange(0, BLOCK_M)
    i = q_tile * BLOCK_Q + m // G
    head = kvh * G + m % G
    d = tl.arange(0, D)
    row0 = tl.load(row_start_ptr + b)
    q_len = tl.load(q_len_ptr + b)
    ctx = tl.load(ctx_ptr + b)
    row_ok = i < q_len
    t = row0 + tl.where(row_ok, i, 0)
    pos = ctx - q_len + i  # each query's own position: it sees keys [0, pos]
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)  # fmt: skip
    # Scores in base 2 (exp2), scaled after the dot: q enters it as stored.
    qk_scale = sm_scale if HAS_SOFTCAP else sm_scale * LOG2E

    # Keys of this split that some row of the tile may see.
    lo = split * SPLIT_KEYS
    hi = tl.minimum(lo + SPLIT_KEYS, ctx - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q))
    hi = tl.where(q_tile * BLOCK_Q < q_len, hi, lo)  # a tile past this entry's queries: no work
    if HAS_WINDOW:
        first_pos = ctx - q_len + q_tile * BLOCK_Q
        lo = tl.maximum(lo, (first_pos - window + 1) // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):  # a for loop: the compiler pipelines its loads
        j = start + n_off  # key positions
        key_ok = j < hi
        jj = tl.where(key_ok, j, 0)
        block = tl.load(table_ptr + b * stride_tb + jj // BS, mask=key_ok, other=0)
        slot = block.to(tl.int64) * BS + jj % BS
        kv_off = (slot * HKV + kvh)[:, None] * D + d[None, :]
        k = _load_kv(k_ptr + kv_off, FMT, DOT_DTYPE)  # [BLOCK_N, D]; masked keys: slot 0 of block 0
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if FMT >= 0:
            s = s * tl.load(ks_ptr + slot * HKV + kvh)[None, :]
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
            s = s * LOG2E
        visible = key_ok[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_ptr + kv_off, FMT, DOT_DTYPE)
        if FMT >= 0:
            p = p * tl.load(vs_ptr + slot * HKV + kvh)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = (t * (HKV * G) + head) * SPLITS + split
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, rows_ptr, stride_ot, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """out[t, h] = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M) over the splits of row t, head h."""
    t = tl.load(rows_ptr + tl.program_id(0))
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    part = (t * HQ + h) * SPLITS
    lse = tl.load(part_lse_ptr + part + s)
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + (part + s)[:, None] * D + d[None, :])
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtypes(dtype: torch.dtype, device: torch.device) -> tuple:
    """(DOT_DTYPE, PRECISION) for queries of `dtype`. On CUDA 16-bit queries meet K/V in their own
    dtype on the tensor cores (codes of a quantized pool are exact there; the probabilities round
    to 16 bits, as flash attention's do); an fp32 model gets full fp32 products. Under the
    interpreter (CPU tensors) 16-bit values go into a tf32 dot, which takes them exactly as well:
    its bf16 arithmetic is wrong."""
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if device.type == "cuda":
        return _TL_DTYPES[dtype], "tf32"
    return tl.float32, "tf32"


def launch_config(q_max: int, group: int, head_dim: int, max_keys: int,
                  prefill: bool = False) -> dict:  # fmt: skip
    """The constexprs and warps of a launch (also what the compile test enumerates).

    Short queries: tiles of at least 16 rows (the dot's minimum) and at most 64, keys split by
    SPLIT_KEYS into a power-of-two count (the merge's tile). A prefill chunk after cached context
    (`prefill`): tiles of 128 rows (64 at head sizes above 128) and no split (its rows are many
    enough to fill the GPU, and the partials of thousands of rows would not be small)."""
    if prefill:
        rows = 128 if head_dim <= 128 else 64
        return {"BLOCK_Q": max(1, rows // group), "BLOCK_N": 64 if head_dim <= 128 else 32,
                "SPLITS": 1, "num_warps": 8}  # fmt: skip
    bq = max(triton.next_power_of_2(q_max), max(1, 16 // group))
    splits = triton.next_power_of_2(max(1, triton.cdiv(max_keys, SPLIT_KEYS)))
    return {"BLOCK_Q": max(1, min(bq, 64 // group)), "BLOCK_N": 64 if head_dim <= 64 else 32,
            "SPLITS": splits, "num_warps": 4}  # fmt: skip


def paged_attention_short(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] float, or uint8 codes with k_scale
    v_cache: torch.Tensor,
    row_start: torch.Tensor,  # [B] int
    q_lens: torch.Tensor,  # [B]
    ctx_lens: torch.Tensor,  # [B] keys after this step
    block_tables: torch.Tensor,  # [B, W]
    out: torch.Tensor,  # [T, Hq, D]
    scale: float,
    q_max: int,  # max(q_lens), known to the host that planned the step
    token_rows: torch.Tensor,  # [N] the flat rows the entries cover (the merge's grid)
    k_scale: torch.Tensor | None = None,  # [NB, BS, Hkv] fp32 (quantized pool only)
    v_scale: torch.Tensor | None = None,
    kv_format: int = FLOAT,
    window: int | None = None,
    softcap: float | None = None,
    prefill: bool = False,  # long chunks: `launch_config`'s prefill tiles
) -> torch.Tensor:
    """Fill `out`'s rows of the entries (module docstring); returns `out`."""
    n_heads, d = q.shape[1], q.shape[2]
    _, bs, n_kv, _ = k_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous head dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1):
        raise ValueError("the KV pool and block tables must be contiguous")
    group = n_heads // n_kv
    num_entries, width = block_tables.shape
    cfg = launch_config(q_max, group, d, width * bs, prefill)
    dot_dtype, precision = dot_dtypes(q.dtype, q.device)
    q_tiles = triton.cdiv(q_max, cfg["BLOCK_Q"])
    splits = cfg["SPLITS"]
    part_o = part_lse = out  # unused placeholders when one split covers every key
    if splits > 1:
        t = q.shape[0]
        part_o = torch.empty((t, n_heads, splits, d), dtype=torch.float32, device=q.device)
        # Every (row, head, split) of the entries is written, an empty split as lse = -inf.
        part_lse = torch.empty((t, n_heads, splits), dtype=torch.float32, device=q.device)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    grid = (num_entries, n_kv * q_tiles, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, ks, vs, row_start, q_lens, ctx_lens, block_tables,
        out, part_o, part_lse, scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), q_tiles,
        HKV=n_kv, G=group, D=d, BS=bs, SPLIT_KEYS=SPLIT_KEYS, FMT=kv_format,
        DOT_DTYPE=dot_dtype, PRECISION=precision,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, **cfg,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(token_rows.numel(), n_heads)](
            part_o, part_lse, out, token_rows, out.stride(0), out.stride(1), HQ=n_heads, D=d,
            SPLITS=splits,
        )  # fmt: skip
    return out
