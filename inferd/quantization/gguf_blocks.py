"""GGUF's 5-bit, 6-bit and K-quant weights (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept at their own bits.

A file's blocks are converted once, losslessly, into the layout the fused kernels read
(csrc/gguf_blocks.h describes it byte by byte): per output row, the 4 low bits of every code as
nibbles (Q4_0's order), the 5th and 6th bits as bit planes, and the sub-block scales as bytes; the
fp16 block scales and mins in `scales` / `mins`. Nothing is rounded: `dequantize` gives gguf's own
values bit for bit. With AVX512-VNNI the engine packs them further into 16-output tiles
(`pack_tiles`), like int8 / int4 weights.

Bits per weight, against the file's: Q5_0 5.5 (5.5), Q5_1 6 (6), Q4_K 4.625 (4.5), Q5_K 5.625
(5.5), Q6_K 6.5625 (6.5625): K-quants' 6-bit sub-block scales take a byte each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from inferd.quantization.formats import QuantizedWeight


@dataclass(frozen=True, slots=True)
class BlockType:
    """One GGUF type as the kernels hold it (csrc/gguf_blocks.h `Traits`)."""

    name: str  # GGUF's: "Q4_K"
    code: int  # the kernels' type code
    bits: int  # of each weight's code q
    group: int  # weights per fp16 scale (and min)
    offset: int  # w = s · (q - offset) (+ min)
    has_mins: bool
    sub: int  # sub-block scales: 0 none, 1 uint8 sc and m per 32, 2 int8 sc per 16
    gguf_bytes: int  # bytes of one GGUF block of `group` weights

    @property
    def format(self) -> str:
        return self.name.lower()

    @property
    def planes(self) -> int:
        return self.bits - 4

    def row_bytes(self, k: int) -> int:
        return k // 2 + k // 8 * self.planes + (k // 16 if self.sub else 0)

    def tile_bytes(self, k: int) -> int:
        return k // 32 * (64 * (4 + self.planes) + (32 if self.sub else 0))


TYPES = {
    t.name: t
    for t in (
        BlockType("Q5_0", 0, 5, 32, 16, False, 0, 22),
        BlockType("Q5_1", 1, 5, 32, 0, True, 0, 24),
        BlockType("Q4_K", 2, 4, 256, 0, True, 1, 144),
        BlockType("Q5_K", 3, 5, 256, 0, True, 1, 176),
        BlockType("Q6_K", 4, 6, 256, 32, False, 2, 210),
    )
}
BY_FORMAT = {t.format: t for t in TYPES.values()}
FORMATS = tuple(BY_FORMAT)
# decoder::LinearWeights kinds (csrc/gguf_blocks.h): 5 + code in the row layout, 10 + code as tiles.
ROWS_KIND, TILES_KIND = 5, 10


def kernel_kind(w: QuantizedWeight) -> int:
    """The C++ decode step's kind code of `w` (a weight of one of these formats)."""
    return (TILES_KIND if w.layout == "tiles" else ROWS_KIND) + BY_FORMAT[w.format].code


# ---- GGUF blocks → the row layout -------------------------------------------------------------
def _halves(b: np.ndarray) -> np.ndarray:
    """fp16 values held as 2 bytes on the last axis → float16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32]: low nibbles, then high ones (Q4_0 / Q5_x order)."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _bits(b: np.ndarray, count: int) -> np.ndarray:
    """[..., count / 8] bytes → [..., count] of 0/1, bit i of the little-endian whole."""
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :count]


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins → sc, m [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """GGUF bytes of an [N, K] matrix → its parts: q uint8 [N, K] (the unsigned codes), d fp16
    [N, K / group], and where the type has them m / dmin fp16 [N, K / group], sc uint8 [N, K / 32]
    and mn uint8 [N, K / 32] (Q4_K / Q5_K), sc int8 [N, K / 16] (Q6_K)."""
    t = TYPES[type_name]
    n, k = shape
    if k % t.group:
        raise ValueError(
            f"{type_name} rows hold blocks of {t.group} weights; K = {k} is not a multiple"
        )
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // t.group, t.gguf_bytes)
    out: dict[str, np.ndarray] = {}
    if t.name in ("Q5_0", "Q5_1"):
        at = 4 if t.has_mins else 2
        out["d"] = _halves(blocks[..., 0:2])
        if t.has_mins:
            out["m"] = _halves(blocks[..., 2:4])
        high = _bits(blocks[..., at : at + 4], 32)
        q = _nibbles(blocks[..., at + 4 :]) | (high << 4)
    elif t.name in ("Q4_K", "Q5_K"):
        out["d"], out["m"] = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
        out["sc"], out["mn"] = _k_scale_min(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(
            n, -1, 4, 32
        )  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if t.name == "Q5_K":  # bit j of byte l: sub-block j, weight l
            qh = blocks[..., 16:48]
            q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    else:  # Q6_K: ql 128, qh 64, scales 16 (int8), d
        ql = blocks[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8
        ).reshape(4, 1)
        q = (ql & 0x0F).reshape(n, -1, 2, 4, 32) | ((qh & 0x03) << 4)
        out["sc"] = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, -1)
        out["d"] = _halves(blocks[..., 208:210])
    out["q"] = np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k)
    if "sc" in out and t.sub == 1:
        out["sc"], out["mn"] = out["sc"].reshape(n, -1), out["mn"].reshape(n, -1)
    return out


def _row_data(t: BlockType, q: np.ndarray, sub: list[np.ndarray]) -> np.ndarray:
    """uint8 [N, row_bytes] from the codes and sub-block scales (csrc/gguf_blocks.h's row layout)."""
    n, k = q.shape
    blocks = q.reshape(n, k // 32, 32)
    parts = [((blocks[..., :16] & 0x0F) | ((blocks[..., 16:] & 0x0F) << 4)).reshape(n, -1)]
    # h = q >> 4: byte e of a block's 4P bytes holds h[4P·j + e] at bits [P·j, P·j + P)
    if t.planes:
        h = (blocks >> 4).reshape(n, k // 32, 8 // t.planes, 4 * t.planes).astype(np.uint16)
        shifts = (np.arange(8 // t.planes, dtype=np.uint16) * t.planes)[:, None]
        parts.append((h << shifts).sum(axis=2).astype(np.uint8).reshape(n, -1))
    parts += [s.view(np.uint8).reshape(n, -1) for s in sub]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K bytes [N, K / group · block bytes] → a QuantizedWeight in
    the row layout, losslessly (codes and scales as the file has them)."""
    from inferd.quantization.formats import QuantizedWeight

    t = TYPES[type_name]
    p = decode_gguf(raw, type_name, shape)
    sub = [p["sc"], p["mn"]] if t.sub == 1 else [p["sc"]] if t.sub == 2 else []
    mins = torch.from_numpy(np.ascontiguousarray(p["m"])) if t.has_mins else None
    return QuantizedWeight(t.format, torch.from_numpy(_row_data(t, p["q"], sub)),
                           torch.from_numpy(np.ascontiguousarray(p["d"])), mins, tuple(shape), t.group,
                           f"GGUF {t.name}")  # fmt: skip



def columns(w: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Input columns [start, end) of a row-layout weight (a row-parallel shard), both on the
    type's block boundaries: every section of a row (nibbles, bit planes, sub-block scales) is
    ordered by 32-weight block, so each is cut at the same blocks."""
    from inferd.quantization.formats import QuantizedWeight

    t, k = BY_FORMAT[w.format], w.shape[1]
    if start % t.group or end % t.group:
        raise ValueError(f"{t.name} weights split along K only at multiples of {t.group}; "
                         f"columns [{start}, {end}) of K = {k} are not")  # fmt: skip
    # Bytes per 32 weights of each section of a row: nibbles, bit planes, sub-block scales.
    per_block = [16, 4 * t.planes] + ([1, 1] if t.sub == 1 else [2] if t.sub == 2 else [])
    parts, offset = [], 0
    for b in per_block:
        parts.append(w.data[:, offset + start // 32 * b : offset + end // 32 * b])
        offset += k // 32 * b
    g0, g1 = start // t.group, end // t.group
    mins = None if w.mins is None else w.mins[:, g0:g1].contiguous()
    return QuantizedWeight(w.format, torch.cat(parts, 1).contiguous(), w.scales[:, g0:g1].contiguous(),
                           mins, (w.shape[0], end - start), t.group, w.source)  # fmt: skip

# ---- the row layout → values ------------------------------------------------------------------
@dataclass(slots=True)
class Parts:
    """A weight's rows unpacked: q int [R, K] (codes less the offset, so w = s · q (+ min)), the
    scale and min of every weight as [R, K] (fp32 values, exact), min None without."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None


def _unpack_rows(w: QuantizedWeight, rows: torch.Tensor | None) -> Parts:
    t = BY_FORMAT[w.format]
    k = w.shape[1]
    if w.layout == "tiles":
        w, rows = _tiles_holding(w, rows)
    data, scales, mins = w.data, w.scales, w.mins
    if rows is not None:
        data, scales = data[rows], scales[rows]
        mins = None if mins is None else mins[rows]
    r, nb = data.shape[0], k // 32
    nib = data[:, : k // 2].reshape(r, nb, 16)
    q = torch.cat([nib & 0x0F, nib >> 4], dim=2).to(torch.int32)
    if t.planes:  # the high bits: see _row_data
        hb = data[:, k // 2 : k // 2 + k // 8 * t.planes].reshape(r, nb, 1, 4 * t.planes)
        lanes = torch.arange(8 // t.planes, dtype=torch.uint8, device=data.device)
        shifts = (lanes * t.planes)[:, None]
        h = (hb >> shifts) & ((1 << t.planes) - 1)  # [R, blocks, 8 / P, 4P]
        q |= h.reshape(r, nb, 32).to(torch.int32) << 4
    q = (q.reshape(r, k) - t.offset).float()
    sub = data[:, t.row_bytes(k) - (k // 16 if t.sub else 0) :]

    def per_weight(v: torch.Tensor, size: int) -> torch.Tensor:
        return v.float().repeat_interleave(size, dim=1)

    if t.sub == 0:
        scale, mn = per_weight(scales, 32), None if mins is None else per_weight(mins, 32)
    elif t.sub == 1:  # (d · sc) per 32, dmin · m per 32
        sc, m = sub[:, :nb].float(), sub[:, nb:].float()
        scale = per_weight(per_weight(scales, 8) * sc, 32)
        mn = -per_weight(per_weight(mins, 8) * m, 32)
    else:  # Q6_K: d · sc per 16
        sc = sub.view(torch.int8).float()
        scale, mn = per_weight(per_weight(scales, 16) * sc, 16), None
    return Parts(q, scale, mn)


def _tiles_holding(
    w: QuantizedWeight, rows: torch.Tensor | None
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """The row layout of the tiles that hold `rows` (all of them for None), and where those rows
    are in it: an embedding lookup unpacks a few tiles, not the whole table."""
    from inferd.quantization.formats import QuantizedWeight

    if rows is None:
        return tiles_to_rows(w), None
    rows = torch.as_tensor(rows).reshape(-1).long()
    if len(rows) and (rows.min() < 0 or rows.max() >= w.shape[0]):
        raise IndexError(f"rows out of range [0, {w.shape[0]})")
    tiles, where = torch.unique(rows // 16, return_inverse=True)
    part = QuantizedWeight(w.format, w.data.reshape(w.scales.shape[0], -1)[tiles], w.scales[tiles],
                           None if w.mins is None else w.mins[tiles], (16 * len(tiles), w.shape[1]),
                           w.group, w.source, "tiles")  # fmt: skip
    return tiles_to_rows(part), where * 16 + rows % 16


def dequantize(w: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [len(rows) or N, K]: gguf's values bit for bit (scale times code, exact; then the min
    added, one rounding)."""
    p = _unpack_rows(w, rows)
    y = p.scale * p.q
    return y if p.min is None else y + p.min


def int8_activation_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] · w^T as the int8-activation kernels compute it, in fp64: x rounded to int8 per
    32-block (formats.quantize_activations), each block's dot with the exact weights."""
    from inferd.quantization.formats import quantize_activations

    q, d, _ = (t.double() for t in quantize_activations(x))
    p = _unpack_rows(w, None)
    exact = p.scale.double() * p.q.double() + (0 if p.min is None else p.min.double())
    n, k = w.shape
    dots = torch.einsum("mbk,nbk->mnb", q, exact.reshape(n, k // 32, 32))
    return (dots * d.unsqueeze(1)).sum(dim=2).float()


# ---- tiles --------------------------------------------------------------------------------------
def pack_tiles(w: QuantizedWeight) -> QuantizedWeight:
    """`w` (row layout, N a multiple of 16) in the 16-output tiles of csrc/gguf_blocks.h."""
    from inferd.quantization.formats import QuantizedWeight

    t = BY_FORMAT[w.format]
    n, k = w.shape
    nt, nb = n // 16, k // 32
    p = _unpack_rows(w, None)
    q = (p.q + t.offset).to(torch.uint8)  # the codes again
    # [tile, lane, block, register, byte] → [tile, block, register, lane, byte]
    q = q.reshape(nt, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)
    regs = [((q[:, :, :4] & 0x0F) | ((q[:, :, 4:] & 0x0F) << 4)).reshape(nt, nb, 256)]
    for plane in range(t.planes):
        bits = ((q >> (4 + plane)) & 1).reshape(nt, nb, 8, 64).numpy()
        regs.append(
            torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little")).reshape(nt, nb, 64)
        )
    regs = torch.cat(regs, dim=2)  # [tile, block, (4 + planes) · 64]
    if t.sub:  # per super-block: its 8 blocks' sub-block scales, then their registers
        sub = w.data[:, -(k // 16) :]
        if t.sub == 1:  # sc [N, nb] then m [N, nb] → per block: 16 sc, 16 m
            sub = sub.reshape(nt, 16, 2, nb).permute(0, 3, 2, 1)
        else:  # sc [N, 2 nb] → per block: 16 of the first half, 16 of the second
            sub = sub.reshape(nt, 16, nb, 2).permute(0, 2, 3, 1)
        regs = torch.cat([sub.reshape(nt, nb // 8, 256), regs.reshape(nt, nb // 8, -1)], dim=2)
    data = regs.reshape(nt, -1).contiguous()

    def tile_table(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.reshape(nt, 16, -1).permute(0, 2, 1).contiguous()

    return QuantizedWeight(w.format, data, tile_table(w.scales), tile_table(w.mins), w.shape, w.group,
                           w.source, "tiles", w.streamed)  # fmt: skip


def tiles_to_rows(w: QuantizedWeight) -> QuantizedWeight:
    """The row layout of a packed weight: `pack_tiles` undone, the same bytes."""
    from inferd.quantization.formats import QuantizedWeight

    t = BY_FORMAT[w.format]
    n, k = w.shape
    nt, nb = n // 16, k // 32
    data = w.data.reshape(nt, nb // 8, -1) if t.sub else w.data.reshape(nt, 1, -1)
    sub_bytes = 256 if t.sub else 0  # per super-block: 8 blocks' sub-block scales, then registers
    regs = data[:, :, sub_bytes:].reshape(nt, nb, 4 + t.planes, 64)
    nib = regs[:, :, :4].reshape(nt, nb, 4, 16, 4)
    q = torch.cat([nib & 0x0F, nib >> 4], dim=2)  # [tile, block, register, lane, byte]
    for plane in range(t.planes):
        masks = regs[:, :, 4 + plane].reshape(nt, nb, 8, 8).numpy()
        bits = np.unpackbits(masks, axis=-1, bitorder="little").reshape(nt, nb, 8, 16, 4)
        q |= torch.from_numpy(bits) << (4 + plane)
    q = q.permute(0, 3, 1, 2, 4).reshape(n, k).numpy()
    sub: list[np.ndarray] = []
    if t.sub:
        s = data[:, :, :sub_bytes].reshape(nt, nb, 2, 16)
        if t.sub == 1:  # → sc [N, nb], m [N, nb]
            s = s.permute(0, 3, 2, 1).reshape(n, 2 * nb)
        else:  # → sc [N, 2 nb]
            s = s.permute(0, 3, 1, 2).reshape(n, 2 * nb)
        sub = [s.numpy()]

    def row_table(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.permute(0, 2, 1).reshape(n, -1).contiguous()

    return QuantizedWeight(w.format, torch.from_numpy(_row_data(t, q, sub)), row_table(w.scales),
                           row_table(w.mins), w.shape, w.group, w.source, "rows", w.streamed)  # fmt: skip


# ---- matmul -------------------------------------------------------------------------------------
_NO_MINS = torch.empty(0, dtype=torch.float16)


def kernel_call(ext, x2: torch.Tensor, w: QuantizedWeight, int8_x: bool) -> torch.Tensor:
    """The fused kernel on x2 [M, K]; with M == 0 (row layout) it returns the dequantised weight."""
    mins = w.mins if w.mins is not None else _NO_MINS
    code = BY_FORMAT[w.format].code
    if w.layout == "tiles":
        return ext.gguf_tiles_linear(x2, w.data, w.scales, mins, code, w.streamed)
    return ext.gguf_blocks_linear(x2, w.data, w.scales, mins, code, int8_x)


def can_pack(w: QuantizedWeight) -> bool:
    return w.layout == "rows" and w.shape[0] % 16 == 0 and w.data.is_cpu


def widen_to_int8(w: QuantizedWeight) -> QuantizedWeight | None:
    """A Q5_0 weight as int8 blocks of 32 with its fp16 scales (q - 16 fits int8: the same values,
    8.5 bits a weight), so that it can share a fused layer with Q8_0 ones; None for other types."""
    from inferd.quantization.formats import QuantizedWeight

    if w.format != "q5_0":
        return None
    rows = w if w.layout == "rows" else tiles_to_rows(w)
    q = _unpack_rows(rows, None).q.to(torch.int8).contiguous()
    return QuantizedWeight("int8", q, rows.scales, None, w.shape, 32, w.source)
