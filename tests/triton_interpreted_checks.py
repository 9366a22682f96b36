"""Run by tests/test_triton_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported): every Triton kernel on CPU tensors against its reference. Prints one JSON line
{check name: max error}."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_interpreter_compat  # noqa: E402

triton_interpreter_compat.apply()

import torch

from inferd.kernels.triton import selfcheck as sc
from inferd.kv.kv_cache import KVCache
from inferd.layers.attention import (
    AttentionMetadata,
    PaddedGroup,
    PrefillSlice,
    TorchAttention,
    TritonAttention,
    _write,
)

f16, f32 = torch.float16, torch.float32
results = {}
# Attention: GQA, partial last blocks, shuffled tables; q_len > 1 (verification); contexts past
# SPLIT_KEYS (split-K and the merge); every KV storage; window and soft-capping.
attention = {
    "fp16_gqa4_q3": dict(
        batch=3, context=40, heads=8, kv_heads=2, head_dim=32, q_len=3, block_size=8, dtype=f16
    ),
    "fp32_mha_splits": dict(batch=2, context=1100, heads=2, kv_heads=2, head_dim=16, dtype=f32),
    "bf16_pool_gqa8": dict(
        batch=2, context=50, heads=8, kv_heads=1, head_dim=16, kv_dtype="bfloat16", dtype=f16
    ),
    "int8_q2": dict(
        batch=2, context=70, heads=4, kv_heads=2, head_dim=32, q_len=2, kv_dtype="int8", dtype=f32
    ),
    "fp8_e4m3_splits": dict(
        batch=1, context=600, heads=4, kv_heads=1, head_dim=16, kv_dtype="fp8_e4m3", dtype=f32
    ),
    "fp8_e5m2": dict(
        batch=2,
        context=30,
        heads=2,
        kv_heads=1,
        head_dim=16,
        q_len=4,
        kv_dtype="fp8_e5m2",
        dtype=f32,
    ),
    "window_softcap": dict(
        batch=2,
        context=90,
        heads=4,
        kv_heads=2,
        head_dim=16,
        q_len=3,
        window=20,
        softcap=30.0,
        dtype=f32,
    ),
    "prefill_tiles": dict(
        batch=1, context=70, heads=4, kv_heads=2, head_dim=16, q_len=40, prefill=True, dtype=f32
    ),
}
for name, kw in attention.items():
    results[f"attention_{name}"] = sc.check_paged_attention("cpu", **kw)["max_err"]
gemm = {
    "int4_g32_f32": dict(m=3, n=40, k=128, fmt="int4", group=32, dtype=f32),
    "int4_g64_f16": dict(m=20, n=64, k=192, fmt="int4", group=64, dtype=f16),
    "int8_blocks_f16": dict(m=1, n=33, k=96, fmt="int8", group=32, dtype=f16),
    "int8_channel_f32": dict(m=5, n=48, k=256, fmt="int8", group=256, dtype=f32),
    "fp8_g32_f32": dict(m=2, n=30, k=64, fmt="fp8", group=32, dtype=f32),
}
for name, kw in gemm.items():
    results[f"gemm_{name}"] = sc.check_quant_gemm("cpu", **kw)["rel_err"]


def backend_against_torch(kv_cache_dtype: str) -> float:
    """TritonAttention.forward (kernel group: a decode and a 3-row verification) against
    TorchAttention.forward (padded group) on one layer of a real pool: the write of the step's
    K/V, the kernel group's plan, and the reading of codes and scales in place."""
    torch.manual_seed(0)
    bs, hq, hkv, d, nb = 4, 4, 2, 16, 12
    cache = KVCache(
        torch.zeros(1, 2, nb, bs, hkv, d, dtype=KVCache.storage_dtype(kv_cache_dtype, f32)),
        kv_cache_dtype,
    )
    k_cache, v_cache = cache.layers()[0]
    # Sequence 0 has 6 cached keys in blocks [5, 2], sequence 1 has 7 in [9, 0, 7]: write them.
    history = [(6, [5, 2]), (7, [9, 0, 7])]
    for n, table in history:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        _write(k_cache, slots, torch.randn(n, hkv, d))
        _write(v_cache, slots, torch.randn(n, hkv, d))
    q_lens, rows = [1, 3], 4
    ctx = [n + q for (n, _), q in zip(history, q_lens)]
    slots = torch.tensor(
        [history[0][1][6 // bs] * bs + 6 % bs]
        + [history[1][1][p // bs] * bs + p % bs for p in range(7, 10)]
    )
    q, k, v = torch.randn(rows, hq, d), torch.randn(rows, hkv, d), torch.randn(rows, hkv, d)
    tables = torch.tensor([[5, 2, 0], [9, 0, 7]])
    token_rows = torch.arange(rows)
    kernel = TritonAttention(d)  # (its supports() would say CUDA only: built here by hand)
    kg = PaddedGroup(
        token_rows,
        torch.tensor([0, 3, 4, 5]),
        tables,
        None,
        3,
        False,
        kernel=kernel.kernel,
        row_start=torch.tensor([0, 1]),
        q_lens=torch.tensor(q_lens),
        ctx_lens=torch.tensor(ctx),
    )
    saved = (cache.data.clone(), None if cache.scales is None else cache.scales.clone())
    out = kernel.forward(
        q, k, v, k_cache, v_cache, AttentionMetadata(slots, bs, None, [], kg), 0.25
    )
    cache.data.copy_(saved[0])
    if saved[1] is not None:
        cache.scales.copy_(saved[1])
    j = torch.arange(12).view(1, 1, 1, -1)
    i = torch.arange(3).view(1, 1, -1, 1)
    ql, cl = torch.tensor(q_lens).view(-1, 1, 1, 1), torch.tensor(ctx).view(-1, 1, 1, 1)
    mask = (j <= cl - ql + i) | ((i >= ql) & (j == 0))
    pg = PaddedGroup(
        token_rows,
        torch.tensor([0, 3, 4, 5]),
        tables,
        mask,
        3,
        False,
        q_lens=torch.tensor(q_lens),
        ctx_lens=torch.tensor(ctx),
    )
    ref = TorchAttention(d).forward(
        q, k, v, k_cache, v_cache, AttentionMetadata(slots, bs, pg, []), 0.25
    )
    return (out - ref).abs().max().item()


def context_chunk_against_torch(kv_cache_dtype: str, window: int | None) -> float:
    """A 40-row chunk after 10 cached keys (a prefix-cache hit, a later chunk), through
    TritonAttention's paged prefill tiles and through the torch backend's gather + mask."""
    torch.manual_seed(1)
    bs, hq, hkv, d, nb, cached, n = 8, 4, 2, 16, 12, 10, 40
    cache = KVCache(
        torch.zeros(1, 2, nb, bs, hkv, d, dtype=KVCache.storage_dtype(kv_cache_dtype, f32)),
        kv_cache_dtype,
    )
    k_cache, v_cache = cache.layers()[0]
    table = [7, 3, 11, 0, 5, 9, 2]  # 50 keys in 7 shuffled blocks, the last one partial
    old = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached)])
    _write(k_cache, old, torch.randn(cached, hkv, d))
    _write(v_cache, old, torch.randn(cached, hkv, d))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached, cached + n)])
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    mask = torch.arange(cached + n).unsqueeze(0) <= torch.arange(cached, cached + n).unsqueeze(1)
    outs = []
    for backend in (TritonAttention(d), TorchAttention(d)):
        saved = (cache.data.clone(), None if cache.scales is None else cache.scales.clone())
        chunk = PrefillSlice(0, n, cached + n, torch.tensor(table), mask)
        outs.append(
            backend.forward(
                q,
                k,
                v,
                k_cache,
                v_cache,
                AttentionMetadata(slots, bs, None, [chunk]),
                0.25,
                window=window,
            )
        )
        cache.data.copy_(saved[0])
        if saved[1] is not None:
            cache.scales.copy_(saved[1])
    return (outs[0] - outs[1]).abs().max().item()


for kv in ("auto", "int8", "fp8"):
    results[f"backend_{kv}"] = backend_against_torch(kv)
    results[f"context_chunk_{kv}"] = context_chunk_against_torch(kv, None)
results["context_chunk_window"] = context_chunk_against_torch("auto", 12)
json.dump(results, sys.stdout)
print()
