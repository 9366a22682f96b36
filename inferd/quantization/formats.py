"""Quantized weight formats: how a [N, K] weight is stored, quantized from fp32, read from GGUF
blocks, dequantized (the reference every kernel is tested against), and multiplied.

Formats (blocks and groups run along K, the input dim, so a row permutation permutes rows of
every tensor alike):
- "int8": data int8 [N, K]; scales [N, K / group] (fp16 for GGUF Q8_0 with group 32, fp32 for
  per-channel with group K); w = q * scale.
- "int4": data uint8 [N, K / 2]; scales and mins [N, K / group] fp16; w = q * scale + min with q
  in 0..15; each 32-weight block's 16 bytes hold weights 0..15 in the low nibbles and 16..31 in the
  high ones — GGUF's Q4_0/Q4_1 byte order, so those load by copying (Q4_0: min = -8 * scale).
- "fp8": data uint8 [N, K] holding float8_e4m3fn bits; scales fp32 [N, K / group]; w = e4m3(q) * scale.
- "q5_0", "q5_1", "q4_k", "q5_k", "q6_k": GGUF's blocks of those types, converted losslessly into
  the layout of their own kernels (gguf_blocks.py); group is the fp16 scales' (32, or 256 for
  K-quants).
  Groups of 32 by default: E4M3's precision is relative, but a per-channel scale set by one large
  weight pushes groups of small ones into its coarse subnormal range (on SmolLM2-135M with absmax
  scales, per-channel costs about half as much perplexity again as groups of 32). Each group's
  scale is the one of 16 candidates with the least rounding error (fp8_scales.py), which brings
  fp8's perplexity cost over fp32 to about 0.1% on the default model (groups of 32, int8 head).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from inferd import envs
from inferd.quantization import gguf_blocks
from inferd.quantization.fp8_scales import FP8_MAX, STEPS, group_scales

FORMATS = ("int8", "int4", "fp8", *gguf_blocks.FORMATS)


@dataclass(slots=True)
class QuantizedWeight:
    format: str  # one of FORMATS
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    shape: tuple[int, int]  # the dequantized [N, K]
    group: int  # weights per scale along K (a multiple of 32; K itself for per-channel)
    source: str = ""  # e.g. "GGUF Q4_1": where the quantization came from
    # "rows": data [N, K] (int4: [N, K / 2]) and scales/mins [N, K / group], as shipped.
    # "tiles": packed at load for the AVX512-VNNI kernels (`pack_tiles`): data has the same bytes
    # rearranged, scales/mins [N / 16, K / 32, 16] in their own dtype (one per 32-block; `group`
    # is still the quantization's). The int8-activation path, `dequantize_rows` and `rows()` read it.
    layout: str = "rows"
    # Read once per step, like a model's weights: the tiles kernel prefetches it past the caches
    # so that the stream does not evict what the step reuses. False for a small weight read many
    # times a step (a draft head's), which should stay in cache.
    streamed: bool = True

    @property
    def nbytes(self) -> int:
        ts = [self.data, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"data": self.data, "scales": self.scales}
        if self.mins is not None:
            out["mins"] = self.mins
        return out

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedWeight:
        """The same weight with its rows reordered/selected by `index`."""
        index = torch.as_tensor(index, dtype=torch.long)
        if self.layout == "tiles" and self.format in gguf_blocks.FORMATS:
            return gguf_blocks.tiles_to_rows(self).rows(index)
        if self.layout == "tiles":  # back to the row layout, with the block scales as fp32 groups of 32
            q, scales, mins = _tile_values(self, index)
            data = q.contiguous() if self.format == "int8" else pack_int4(q)
            return QuantizedWeight(self.format, data, scales.contiguous(),
                                   None if mins is None else mins.contiguous(),
                                   (len(index), self.shape[1]), 32, self.source)  # fmt: skip
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(self.format, self.data[index].contiguous(),
                               self.scales[index].contiguous(), mins,
                               (len(index), self.shape[1]), self.group, self.source)  # fmt: skip

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """The same weight's input columns [start, end) (a row-parallel shard), which must fall on
        its blocks' and groups' boundaries: ValueError naming the shape otherwise."""
        if self.layout == "tiles":
            return self.rows(torch.arange(self.shape[0])).columns(start, end)
        if self.format in gguf_blocks.FORMATS:
            return gguf_blocks.columns(self, start, end)
        k = self.shape[1]
        per_channel = self.group == k
        step = 32 if per_channel else self.group
        if start % step or end % step:
            raise ValueError(f"a {self.format} weight [{self.shape[0]}, {k}] in groups of {step} "
                             f"cannot split along K at [{start}, {end})")  # fmt: skip
        div = 2 if self.format == "int4" else 1  # int4: two codes a byte, a block's bytes together
        scales = self.scales if per_channel else self.scales[:, start // self.group : end // self.group]
        mins = self.mins
        if mins is not None and not per_channel:
            mins = mins[:, start // self.group : end // self.group]
        return QuantizedWeight(
            self.format, self.data[:, start // div : end // div].contiguous(), scales.contiguous(),
            None if mins is None else mins.contiguous(), (self.shape[0], end - start),
            end - start if per_channel else self.group, self.source,
        )  # fmt: skip

    def to(self, device: torch.device) -> QuantizedWeight:
        if self.layout != "rows" and torch.device(device).type != "cpu":
            raise ValueError("packed tiles are a CPU layout")
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedWeight(self.format, self.data.to(device), self.scales.to(device), mins,
                               self.shape, self.group, self.source, self.layout)  # fmt: skip


def bytes_of(w: torch.Tensor | QuantizedWeight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


# ---- dequantization (the reference) ----------------------------------------------------------
def _expand(groups: torch.Tensor, group: int) -> torch.Tensor:
    """[R, K / group] → [R, K], each value repeated over its group."""
    return groups.float().repeat_interleave(group, dim=1)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K / 2] → uint8 [R, K] of values 0..15 in weight order."""
    r = data.shape[0]
    blocks = data.reshape(r, -1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(r, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K] of 0..15 → [R, K / 2]; inverse of `unpack_int4`."""
    r = q.shape[0]
    blocks = q.reshape(r, -1, 32)
    return (blocks[:, :, :16] | (blocks[:, :, 16:] << 4)).reshape(r, -1).contiguous()


def dequantize_rows(w: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [len(rows) or N, K]; `rows` selects rows first (an embedding lookup)."""
    if w.format in gguf_blocks.FORMATS:
        return gguf_blocks.dequantize(w, rows)
    if w.layout == "tiles":
        return _dequantize_tiles(w, rows)
    data, scales, mins = w.data, w.scales, w.mins
    if rows is not None:
        data, scales = data[rows], scales[rows]
        mins = None if mins is None else mins[rows]
    if w.format == "int8":
        return data.float() * _expand(scales, w.group)
    if w.format == "int4":
        return unpack_int4(data).float() * _expand(scales, w.group) + _expand(mins, w.group)
    if w.format == "fp8":
        return data.view(torch.float8_e4m3fn).float() * _expand(scales, w.group)
    raise ValueError(f"unknown quantized format {w.format!r}")


def _tile_values(w: QuantizedWeight, rows: torch.Tensor | None):
    """Rows of a packed weight as (q [R, K]: int8, or uint8 0..15 for int4; scales [R, K / 32];
    mins [R, K / 32] or None). Output n is lane n % 16 of tile n // 16; register k of a block
    holds its weights 4k..4k+3 (int4: registers k and k + 4 share a byte)."""
    n, k = w.shape
    nb = k // 32
    rows = torch.arange(n) if rows is None else torch.as_tensor(rows).reshape(-1).long()
    tile, lane = rows // 16, rows % 16
    pick = torch.arange(len(rows))
    raw = w.data.view(torch.uint8).reshape(n // 16, -1)[tile]  # the rows' tiles, whole
    if w.format == "int8":
        q = (raw.view(-1, nb, 8, 16, 4) ^ 0x80).view(torch.int8)
    else:
        both = raw.view(-1, nb, 4, 16, 4)
        q = torch.cat([both & 0x0F, both >> 4], dim=2)  # registers 0-3, then 4-7
    q = q.permute(0, 3, 1, 2, 4)[pick, lane].reshape(len(rows), k)
    mins = None if w.mins is None else w.mins[tile, :, lane]
    return q, w.scales[tile, :, lane], mins


def _dequantize_tiles(w: QuantizedWeight, rows: torch.Tensor | None) -> torch.Tensor:
    ext = _kernels()
    if rows is not None and ext is not None and w.data.is_cpu:  # an embedding lookup: C++, the same bits
        mins = w.mins if w.mins is not None else torch.empty(0, dtype=w.scales.dtype)
        return ext.tiles_rows(w.data, w.scales, mins, torch.as_tensor(rows).reshape(-1).long().contiguous())
    return _dequantize_tiles_torch(w, rows)


def _dequantize_tiles_torch(w: QuantizedWeight, rows: torch.Tensor | None) -> torch.Tensor:
    q, scales, mins = _tile_values(w, rows)
    y = q.float() * scales.repeat_interleave(32, dim=1)
    return y if mins is None else y + mins.repeat_interleave(32, dim=1)


def pack_tiles(w: QuantizedWeight) -> QuantizedWeight | None:
    """`w` in the packed layout of the AVX512-VNNI kernels, or None where it cannot take it
    (no such kernels, int8 activations forced off — tiles have no fp32-activation kernel —, fp8,
    an output count that is not a multiple of 16, another device). GGUF's 5- / 6-bit and K-quant
    types have tiles of their own (gguf_blocks.pack_tiles)."""
    ext = _kernels()
    n, k = w.shape
    if w.format in gguf_blocks.FORMATS:
        usable = ext is not None and ext.has_int8_gemm and INT8_ACTIVATIONS is not False
        return gguf_blocks.pack_tiles(w) if usable and gguf_blocks.can_pack(w) else None
    if (ext is None or not ext.has_int8_gemm or INT8_ACTIVATIONS is False or w.layout != "rows"
            or w.format not in ("int8", "int4") or n % 16 or k % 32 or not w.data.is_cpu):  # fmt: skip
        return None
    data, scales, mins = ext.pack_int8_tiles(w.data, w.scales, w.mins, w.group)
    # `group` stays the quantization's own (the packed scales repeat it per 32-block).
    return QuantizedWeight(w.format, data, scales, mins if w.mins is not None else None, w.shape,
                           w.group, w.source, "tiles")  # fmt: skip


def dequantize(w: QuantizedWeight | torch.Tensor) -> torch.Tensor:
    return dequantize_rows(w) if isinstance(w, QuantizedWeight) else w


# ---- quantization from fp32 ------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Per-output-channel symmetric int8 (fp32 scale per row)."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.contiguous(), scale.contiguous(), None, tuple(w.shape),
                           w.shape[1], "per-channel int8")  # fmt: skip


def quantize_int8_blocks(w: torch.Tensor) -> QuantizedWeight:
    """Q8_0-like: symmetric int8 with an fp16 scale per 32 weights."""
    w = w.float()
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(dim=2) / 127.0).half()
    s = scale.float().clamp_min(1e-12).unsqueeze(2)
    q = torch.round(blocks / s).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight("int8", q, scale.contiguous(), None, (n, k), 32, "int8 blocks of 32")


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Group-wise asymmetric int4 (Q4_1-like): fp16 scale and min per `group` weights."""
    w = w.float()
    n, k = w.shape
    if group % 32 or k % group:
        raise ValueError(f"int4 group {group} must be a multiple of 32 dividing K={k}")
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).half()
    mins = lo.half()
    s = scale.float().clamp_min(1e-12).unsqueeze(2)
    q = torch.round((g - mins.float().unsqueeze(2)) / s).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", pack_int4(q.reshape(n, k)), scale.contiguous(),
                           mins.contiguous(), (n, k), group, f"int4 group {group}")  # fmt: skip


def quantize_fp8(w: torch.Tensor, group: int | None = None, steps: int = STEPS) -> QuantizedWeight:
    """float8_e4m3fn with an fp32 scale per `group` weights along K (None: per output channel):
    each group's scale is the one of `steps` candidates, absmax / 448 * 2^(j / steps), with the
    least squared rounding error (`steps=1`: the group's max |w| maps to 448)."""
    w = w.float().contiguous()
    n, k = w.shape
    group = group or k
    if group % 32 or k % group:
        raise ValueError(f"fp8 group {group} must be a multiple of 32 dividing K={k}")
    g = w.reshape(n, k // group, group)
    scale = group_scales(w, group, steps).unsqueeze(2)  # [N, K / group, 1]
    q = (g / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(n, k)
    what = "per-channel" if group == k else f"group {group}"
    return QuantizedWeight("fp8", q.view(torch.uint8).contiguous(), scale.reshape(n, -1).contiguous(),
                           None, (n, k), group, f"fp8 e4m3 {what}")  # fmt: skip


def quantize(w: torch.Tensor, fmt: str, group: int = 32) -> QuantizedWeight:
    if w.shape[1] % 32:
        raise ValueError(f"cannot quantize a weight whose input dim {w.shape[1]} is not a "
                         "multiple of 32")  # fmt: skip
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w, group)
    if fmt == "fp8":
        return quantize_fp8(w, group)
    raise ValueError(f"unknown quantized format {fmt!r}")


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format and group along N (fused qkv, gate_up)."""
    first = parts[0]
    if any(p.format != first.format or p.group != first.group or p.shape[1] != first.shape[1]
           or p.scales.dtype != first.scales.dtype for p in parts):  # fmt: skip
        raise ValueError("cat_rows needs weights of one format, group and scale dtype")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    n = sum(p.shape[0] for p in parts)
    return QuantizedWeight(first.format, torch.cat([p.data for p in parts]),
                           torch.cat([p.scales for p in parts]), mins, (n, first.shape[1]),
                           first.group, first.source)  # fmt: skip


# ---- GGUF blocks -----------------------------------------------------------------------------
# Bytes per 32-weight block and the layout of one block: fp16 d [, fp16 m], then the quants.
GGUF_NATIVE = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# Every GGUF type a matrix stays packed in (`-q auto`): those above, and gguf_blocks' 5- / 6-bit
# and K-quant types.
GGUF_PACKED = (*GGUF_NATIVE, *gguf_blocks.TYPES)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF bytes [N, K / block * block_bytes] of a GGUF_PACKED type → a QuantizedWeight, without
    an fp32 detour: Q8_0/Q4_0/Q4_1 by copying bytes (the scales and mins stay the file's fp16
    values), the others converted losslessly (gguf_blocks.from_gguf)."""
    if type_name in gguf_blocks.TYPES:
        return gguf_blocks.from_gguf(raw, type_name, shape)
    n, k = shape
    bb = GGUF_NATIVE[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, bb)
    d = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].copy())
    source = f"GGUF {type_name}"
    if type_name == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k))
        return QuantizedWeight("int8", q, d, None, (n, k), 32, source)
    if type_name == "Q4_1":
        m = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].copy())
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]).reshape(n, k // 2))
        return QuantizedWeight("int4", q, d, m, (n, k), 32, source)
    # Q4_0: w = (q - 8) * d = q * d + (-8 d); -8 d is exact in fp16 (a power-of-two multiple).
    q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).reshape(n, k // 2))
    return QuantizedWeight("int4", q, d, (d.float() * -8.0).half(), (n, k), 32, source)


# ---- int8 activations (the decode kernels' numerics) -----------------------------------------
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 → (q [M, K / 32, 32] int8 as float, d [M, K / 32], d · Σ q [M, K / 32]):
    per 32-block x ≈ d · q with d = max|x| / 127, rounded half to even — bit for bit what the
    kernels compute (int8_dot.h), so the reference below differs from them only in summation order.
    The block sums are of the rounded x, for int4's min term (int8_dot.h says why)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(dim=2) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(2))
    return q, d, d * q.sum(dim=2)


def int8_activation_matmul_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] · w^T as the int8-activation kernels compute it, in fp64: Σ_b s·d_b·(qw·q)_b,
    plus min · d · Σ q for int4. The kernels' own tests compare against this."""
    if w.format in gguf_blocks.FORMATS:
        return gguf_blocks.int8_activation_reference(x, w)
    if w.format not in ("int8", "int4"):
        raise ValueError(f"int8 activations serve int8 and int4 weights, not {w.format!r}")
    q, d, sums = (t.double() for t in quantize_activations(x))
    n, k = w.shape
    qw = (unpack_int4(w.data) if w.format == "int4" else w.data).double().reshape(n, k // 32, 32)

    def per_block(v: torch.Tensor) -> torch.Tensor:  # [N, K / group] → [N, K / 32]
        return v.double().repeat_interleave(w.group // 32, dim=1)

    dots = torch.einsum("mbk,nbk->mnb", q, qw)  # [M, N, K/32] integer block dots
    y = (dots * d.unsqueeze(1) * per_block(w.scales).unsqueeze(0)).sum(dim=2)
    if w.format == "int4":
        y = y + sums @ per_block(w.mins).T
    return y.float()


# int8 activations: int8 and int4 weights meet activations rounded to int8 per 32-block and
# integer block dots, as llama.cpp does — decode ~1.5x faster, perplexity +0.2-0.5%. Every row of
# every call takes them: the kernels give a row the same bits alone or among any number of rows
# (int8_dot.h), and that must hold end to end, because rounding to int8 turns a 1e-6 difference
# upstream into int8-noise-sized ones (a row prefilled through the BLAS sgemm alone and through the
# fused kernel in a batch can differ by ~1e-5 in fp32, then by 0.1 nats at the next token once
# rounded). Prefill on the many-row integer tiles runs at about the sgemm's speed on the
# dequantised weight. INFERD_INT8_ACTIVATIONS=1/0 forces them on/off; by default (None) they are on
# where the kernels have those tiles (AVX512-VNNI): elsewhere prefill would run on the one-row
# kernel, ~2x slower.
INT8_ACTIVATIONS: bool | None = envs.INFERD_INT8_ACTIVATIONS


@contextlib.contextmanager
def int8_activations(on: bool = True):
    """Within: int8/int4 matmuls take int8 activations (on) or fp32 ones (off), whatever the
    default — perplexity measures both."""
    global INT8_ACTIVATIONS
    saved, INT8_ACTIVATIONS = INT8_ACTIVATIONS, on
    try:
        yield
    finally:
        INT8_ACTIVATIONS = saved


# ---- matmul ------------------------------------------------------------------------------------
_EXT: object = None  # the compiled kernels once looked up; False where they cannot be built


def _kernels():
    global _EXT
    if _EXT is None:
        from inferd.kernels.quant_gemm import extension

        _EXT = extension() or False
    return _EXT or None


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, use_kernels: bool = True,
                     int8_activations: bool | None = None) -> torch.Tensor:
    """x [..., K] · dequant(w)^T → [..., N]: the fused CPU kernels for fp32 CPU input, the Triton
    GEMM (inferd/kernels/triton) for CUDA input, else (other dtypes, no compiler, no triton, a
    format it lacks) dequantize-then-matmul in PyTorch. With
    `int8_activations` (None: INT8_ACTIVATIONS) int8/int4 weights take the integer-dot kernels
    (x rounded to int8 per 32-block; fp32 accumulation); fp8 weights, and the others without
    them, fp32 activations on the dequantised weight. Either way a row's result does not depend
    on how many rows the call has (csrc/quant_gemm.h)."""
    # ~210 calls per decoded token: the checks below are kept to attribute reads (~1 ms a token).
    if use_kernels and x.is_cpu and x.dtype == torch.float32:
        ext = _EXT if _EXT is not None else _kernels()
        if ext:
            flat = x.dim() == 2
            x2 = x if flat else x.reshape(-1, w.shape[1])
            if int8_activations is None:
                int8_activations = int8_activations_default(ext)
            if int8_activations and w.format != "fp8":
                y = _kernel_call(ext, x2 if x2.is_contiguous() else x2.contiguous(), w, True)
            elif w.layout == "tiles":  # fp32 activations on a packed weight: dequantise (slow)
                y = ext.dense_linear(x2, dequantize_rows(w))
            else:
                y = _kernel_call(ext, x2.contiguous(), w)
            return y if flat else y.view(*x.shape[:-1], w.shape[0])
    if use_kernels and x.is_cuda:
        from inferd.kernels.triton import cuda_quant_matmul

        y = cuda_quant_matmul(x, w)
        if y is not None:
            return y
    if use_kernels and not _REPORTED_DEQUANTIZE:
        _report_dequantize(x, w)
    return F.linear(x, dequantize_rows(w).to(x.dtype))


_REPORTED_DEQUANTIZE = False  # the hot path checks this bool only


def _report_dequantize(x: torch.Tensor, w: QuantizedWeight) -> None:
    global _REPORTED_DEQUANTIZE
    _REPORTED_DEQUANTIZE = True
    from inferd.slow_paths import warn_slow_path

    warn_slow_path("dequantize-matmul", "%s weights on %s %s input are dequantised whole at every call "
                   "(no fused kernel for it): decoding reads ~4-8x the weight bytes; --quantization "
                   "none keeps plain weights", w.format, x.device.type, str(x.dtype).removeprefix("torch."))


def int8_activations_default(ext) -> bool:
    """Whether int8 / int4 matmuls take int8 activations now: INT8_ACTIVATIONS where set, else
    where the kernels have the VNNI tiles (`ext.has_int8_gemm`)."""
    return ext.has_int8_gemm if INT8_ACTIVATIONS is None else INT8_ACTIVATIONS


_NO_MINS = torch.empty(0)


def _kernel_call(ext, x2: torch.Tensor, w: QuantizedWeight, int8_x: bool = False) -> torch.Tensor:
    """The fused kernel on x2 [M, K]; with M == 0 it returns the dequantised weight [N, K]."""
    if w.format in gguf_blocks.FORMATS:
        return gguf_blocks.kernel_call(ext, x2, w, int8_x)
    if w.layout == "tiles":  # int8 activations only (quantized_matmul routes the rest)
        mins = w.mins if w.mins is not None else _NO_MINS
        return ext.tiles_linear(x2, w.data, w.scales, mins, w.streamed)
    if w.format == "int8":
        return ext.q8_linear(x2, w.data, w.scales, w.group, int8_x)
    if w.format == "int4":
        return ext.q4_linear(x2, w.data, w.scales, w.mins, w.group, int8_x)
    return ext.fp8_linear(x2, w.data, w.scales, w.group)
