"""Weight-only quantized GEMM / GEMV on CUDA (Triton), reading inferd's own row layout
(inferd/quantization/formats.py) as it lies in memory: y [M, N] = x [M, K] · dequant(w)^T.

- "int8": int8 codes [N, K], scales [N, K / group] (fp16 or fp32): w = q · s;
- "int4": uint8 [N, K / 2], each 32-weight block's 16 bytes holding weights 0..15 in the low
  nibbles and 16..31 in the high ones (GGUF's Q4_0 / Q4_1 order); fp16 scales and mins
  [N, K / group]: w = q · s + min;
- "fp8": float8_e4m3fn bits [N, K], fp32 scales [N, K / group]: w = e4m3(q) · s.

Each program dequantizes a [BLOCK_N, BLOCK_K] tile of the weight in registers (one scale load per
32-weight block) to x's dtype (the rounding `F.linear(x, dequantize(w).to(x.dtype))` makes, so
the PyTorch path is the reference) and accumulates `tl.dot`s in fp32. An int4 tile is taken as its low and high nibbles, each
multiplied by the matching columns of x: two dots and no interleaving. Small M (decodes) splits
K over programs so that a GEMV fills the GPU; the partial sums are added in a fixed order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FORMATS = ("int8", "int4", "fp8")


@triton.jit
def _block_scales(ptr, n, n_ok, k0, K: tl.constexpr, GROUP: tl.constexpr, NB: tl.constexpr):
    """The scale (or min) of each 32-weight block of rows `n` [BLOCK_N] from column k0 on:
    [BLOCK_N, NB] fp32, one load per block rather than one per weight."""
    g = (k0 // 32 + tl.arange(0, NB)) * 32 // GROUP
    return tl.load(ptr + n[:, None] * (K // GROUP) + g[None, :], mask=n_ok[:, None], other=0.0).to(
        tl.float32
    )


@triton.jit
def _per_weight(s, BLOCK_N: tl.constexpr, NB: tl.constexpr, W: tl.constexpr):
    """Block values s [BLOCK_N, NB] repeated over their W weights: [BLOCK_N, NB * W]."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, NB, W]), [BLOCK_N, NB * W])


@triton.jit
def _quant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, y_ptr,
    M, N, stride_xm,
    K: tl.constexpr, GROUP: tl.constexpr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """x [M, K]; the weight's data, scales and mins as the module docstring says; y [SPLIT_K, M, N]."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, n < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    x_dtype = x_ptr.dtype.element_ty
    NB: tl.constexpr = BLOCK_K // 32  # 32-weight blocks per tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    for kt in range(0, K_SPLIT, BLOCK_K):  # static bounds: pipelined (and the interpreter's)
        k0 = split * K_SPLIT + kt
        scale = _block_scales(s_ptr, n, n_ok, k0, K, GROUP, NB)
        if FMT == "int4":
            # Byte c of the tile holds weights k_lo (low nibble) and k_lo + 16 (high nibble).
            c = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            k_lo = (c // 16) * 32 + c % 16
            raw = tl.load(w_ptr + n[:, None] * (K // 2) + c[None, :], mask=n_ok[:, None], other=0)
            scale = _per_weight(scale, BLOCK_N, NB, 16)
            mins = _per_weight(_block_scales(m_ptr, n, n_ok, k0, K, GROUP, NB), BLOCK_N, NB, 16)
            w_lo = ((raw & 0x0F).to(tl.float32) * scale + mins).to(x_dtype).to(DOT_DTYPE)
            w_hi = ((raw >> 4).to(tl.float32) * scale + mins).to(x_dtype).to(DOT_DTYPE)
            x_lo = tl.load(x_rows + k_lo[None, :], mask=m_ok[:, None], other=0.0).to(DOT_DTYPE)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=m_ok[:, None], other=0.0)
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision=PRECISION)
            acc += tl.dot(x_hi.to(DOT_DTYPE), tl.trans(w_hi), input_precision=PRECISION)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            raw = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=n_ok[:, None], other=0)
            if FMT == "int8":
                q = raw.to(tl.float32)
            else:
                q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            w = (q * _per_weight(scale, BLOCK_N, NB, 32)).to(x_dtype).to(DOT_DTYPE)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0).to(DOT_DTYPE)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    y = y_ptr + split * M * N + rm[:, None] * N + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_k(k: int) -> int:
    """The largest of 128, 64, 32 dividing K (quantized weights have K % 32 == 0)."""
    return next(b for b in (128, 64, 32) if k % b == 0)


def launch_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """Tiles for an [M, K] · [K, N] call. Decode-sized M takes narrow N tiles and splits K until
    the grid has about two programs per SM (a power of two that divides K into whole tiles)."""
    bk = block_k(k)
    if m <= 16:
        bm, bn = 16, 32
    elif m <= 64:
        bm, bn = 32 if m <= 32 else 64, 64
    else:
        bm, bn = 64, 128
    split = 1
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    while programs * split * 2 <= 2 * num_sms and (k // bk) % (split * 2) == 0 and split < 16:
        split *= 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: no reason to split
    return torch.cuda.get_device_properties(device).multi_processor_count


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtypes(dtype: torch.dtype, device: torch.device) -> tuple:
    """(DOT_DTYPE, PRECISION) for activations of `dtype`: on CUDA the tensor cores in x's own
    dtype (fp32: full fp32 products). Under the interpreter (CPU tensors) 16-bit values go into
    a tf32 dot instead, which multiplies them exactly as well: its bf16 arithmetic is wrong."""
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if device.type == "cuda":
        return _TL_DTYPES[dtype], "tf32"
    return tl.float32, "tf32"


def quant_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    n: int,
) -> torch.Tensor:
    """y [M, N] in x's dtype (module docstring for the formats)."""
    if fmt not in FORMATS:
        raise ValueError(f"the Triton quantized GEMM reads {', '.join(FORMATS)}, not {fmt!r}")
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if k % 32 or group % 32 or k % group:
        raise ValueError(f"K={k} and group={group} must be multiples of 32, group dividing K")
    if m == 0:
        return x.new_empty((0, n))
    cfg = launch_config(m, n, k, _num_sms(x.device))
    dot_dtype, precision = dot_dtypes(x.dtype, x.device)
    split = cfg["SPLIT_K"]
    out_dtype = x.dtype if split == 1 else torch.float32
    y = torch.empty((split, m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _quant_gemm_kernel[grid](
        x, data, scales, mins if mins is not None else scales, y, m, n, x.stride(0),
        K=k, GROUP=group, FMT=fmt, DOT_DTYPE=dot_dtype, PRECISION=precision, **cfg,
    )  # fmt: skip
    return y[0] if split == 1 else y.sum(0).to(x.dtype)
