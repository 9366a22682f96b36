"""Each Triton kernel against its PyTorch reference on realistic inputs, with a timing: what
benchmarks/gpu_check.py calls on a GPU, and what the tests run at small shapes on CPU tensors
under `TRITON_INTERPRET=1`. Every function returns a dict ending in plain numbers (JSON-ready).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from inferd.kernels.triton import paged_attention as pa
from inferd.kernels.triton.quant_gemm import quant_gemm
from inferd.kv.kv_cache import dequantize_kv, kv_format, quantize_kv
from inferd.quantization import formats


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn))
    t0 = time.perf_counter()  # the interpreter: one run, a figure of no meaning beyond "it ran"
    fn()
    return (time.perf_counter() - t0) * 1e3


def check_paged_attention(
    device: str | torch.device, batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
    kv_dtype: str = "auto", q_len: int = 1, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
    window: int | None = None, softcap: float | None = None, prefill: bool = False, seed: int = 0,
) -> dict:  # fmt: skip
    """`batch` sequences of about `context` keys (each a few shorter than the last, so last blocks
    are partial) with `q_len` query rows each, K/V in shuffled blocks of a pool stored as
    `kv_dtype` ("auto": `dtype`; "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2").
    `prefill`: the tiles of a long chunk after cached context (one entry, no key split). Returns
    max_err against fp32 attention over the stored (dequantized) K/V, ms, gbps (K/V bytes read
    per second)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)  # block placement
    gd = torch.Generator(device=device).manual_seed(seed)  # values: made where they are used
    ctx = [max(q_len, context - 3 * b) for b in range(batch)]
    nblk = [(c + block_size - 1) // block_size for c in ctx]
    num_blocks = sum(nblk) + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gd, device=device)
    v = torch.randn(shape, generator=gd, device=device)
    fmt = kv_format(kv_dtype)
    quant = {}
    if fmt is None:
        store = dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)
        k_pool, v_pool = k.to(store), v.to(store)
        k_ref, v_ref = k_pool.float(), v_pool.float()
    else:
        (k_pool, ks), (v_pool, vs) = quantize_kv(k, fmt), quantize_kv(v, fmt)
        k_ref, v_ref = (
            dequantize_kv(k_pool, ks, fmt, torch.float32),
            dequantize_kv(v_pool, vs, fmt, torch.float32),
        )
        quant = {"k_scale": ks, "v_scale": vs, "kv_format": fmt.kernel_code}
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(nblk)
    tables = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor(perm[sum(nblk[:b]) : sum(nblk[: b + 1])])
    tables = tables.to(device)
    t = batch * q_len
    q = torch.randn(t, heads, head_dim, generator=gd, device=device).to(dtype)
    row_start = torch.arange(0, t, q_len, device=device)
    q_lens = torch.full((batch,), q_len, device=device)
    ctx_lens = torch.tensor(ctx, device=device)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    rows = torch.arange(t, device=device)

    def run():
        pa.paged_attention_short(q, k_pool, v_pool, row_start, q_lens, ctx_lens, tables, out,
                                 scale, q_len, rows, window=window, softcap=softcap,
                                 prefill=prefill, **quant)  # fmt: skip

    run()
    ref = torch.empty(t, heads, head_dim, device=device)
    for b in range(batch):
        blocks = tables[b, : nblk[b]]
        kb = k_ref.index_select(0, blocks).view(-1, kv_heads, head_dim)[: ctx[b]]
        vb = v_ref.index_select(0, blocks).view(-1, kv_heads, head_dim)[: ctx[b]]
        qb = q[b * q_len : (b + 1) * q_len].float()
        scores = (
            torch.einsum("qhd,khd->hqk", qb, kb.repeat_interleave(heads // kv_heads, 1)) * scale
        )
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx[b] - q_len, ctx[b], device=device)[:, None]
        j = torch.arange(ctx[b], device=device)[None, :]
        visible = j <= pos
        if window is not None:
            visible &= j > pos - window
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        ref[b * q_len : (b + 1) * q_len] = torch.einsum(
            "hqk,khd->qhd", p, vb.repeat_interleave(heads // kv_heads, 1)
        )
    err = (out.float() - ref).abs().max().item()
    ms = _time_ms(run, device)
    elem = k_pool.element_size()
    kv_bytes = sum(ctx) * kv_heads * (head_dim * elem + (4 if fmt is not None else 0)) * 2
    return {"max_err": err, "ms": ms, "gbps": kv_bytes / ms / 1e6}


def check_quant_gemm(
    device: str | torch.device, m: int, n: int, k: int, fmt: str, group: int = 32,
    dtype: torch.dtype = torch.bfloat16, seed: int = 0,
) -> dict:  # fmt: skip
    """x [m, k] · w^T for a random w [n, k] quantized as `fmt` ("int4", "int8" with fp16 scales
    per `group`, "fp8"). Returns max_err and rel_err against F.linear on the dequantized weight
    rounded to `dtype` (the PyTorch path), ms, gbps (weight bytes per second) and tflops."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    w_full = torch.randn(n, k, generator=g, device=device) * 0.02
    if fmt == "int8":
        w = formats.quantize_int8_blocks(w_full)
        if group != 32:
            w = formats.quantize_int8(w_full)
    else:
        w = formats.quantize(w_full, fmt, group)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    y = quant_gemm(x, w.format, w.data, w.scales, w.mins, w.group, n)
    ref = F.linear(x.float(), formats.dequantize_rows(w).to(dtype).float())
    err = (y.float() - ref).abs().max().item()
    ms = _time_ms(lambda: quant_gemm(x, w.format, w.data, w.scales, w.mins, w.group, n), device)
    return {"max_err": err, "rel_err": err / max(ref.abs().max().item(), 1e-30), "ms": ms,
            "gbps": w.nbytes / ms / 1e6, "tflops": 2 * m * n * k / ms / 1e9}  # fmt: skip
