"""The KV tensors of every layer, stored as `--kv-cache-dtype` says: the model's dtype (`auto`), a
2-byte float (`float16`, `bfloat16`: rounded as written, widened as read; llama.cpp's default
cache is f16), or one byte per element (`int8`, `fp8` = `fp8_e4m3`, `fp8_e5m2`) with one fp32
scale per (slot, kv head), quantized as K/V are written and dequantized as attention reads them.

Why a narrower cache than the model: a decode step reads every sequence's whole context, so at
batch 32 on the CPU, attention is bound by memory bandwidth (fp32, 190-token contexts: 280 MB a
step), and its bytes are what a smaller element saves.

The scale is dynamic: each new token's head vector is scaled so its largest |value| maps to the
format's largest code, so nothing needs calibrating and an outlier in one token or head costs
precision only there. With the default model's head_dim 64 a slot-head takes 64 + 4 bytes instead
of 256 (fp32): the same memory holds 3.76x the tokens (1.88x against bf16).

Layout: data [layers, 2 (k/v; 1 for MLA latents, K and V alike), num_blocks, block_size, kv_heads,
head_dim] (uint8 codes when quantized), scales [layers, 2, num_blocks, block_size, kv_heads] fp32
(quantized only). With KV cache groups (inferd/kv/kv_groups.py) the first dimension is one
group's layers: a block id is a page of that many layers, and each layer of the model maps to one
of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferd.config import KV_CACHE_DTYPES, ModelConfig

# Plain (unscaled) storage narrower than an fp32 model's: the kernel widens these in registers.
_FLOAT_STORAGE = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One byte per element: `code_dtype` values stored as their uint8 bits."""

    name: str  # "int8" | "fp8_e4m3" | "fp8_e5m2"
    code_dtype: torch.dtype
    qmax: float  # largest finite code: a head vector's max |value| maps to it
    kernel_code: int  # the format's number in csrc/paged_attention.h


_FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 1),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2),
}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The quantized format of a `--kv-cache-dtype`, or None for plain float storage (`auto`,
    `float16`, `bfloat16`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "auto" or kv_cache_dtype in _FLOAT_STORAGE:
        return None
    return _FORMATS["fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype]


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a model computing in `dtype`."""
    if kv_format(kv_cache_dtype) is not None:
        return torch.uint8
    return _FLOAT_STORAGE.get(kv_cache_dtype, dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Pool bytes one token takes over all layers, K and V, scales included."""
    fmt = kv_format(kv_cache_dtype)
    if fmt is None:
        return cfg.kv_bytes_per_token(storage_dtype(kv_cache_dtype, dtype))
    planes, heads, head_dim = cfg.kv_layout()
    return planes * cfg.num_layers * heads * (head_dim + 4)


def describe(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    fmt = kv_format(kv_cache_dtype)
    return (
        str(storage_dtype(kv_cache_dtype, dtype)).removeprefix("torch.")
        if fmt is None
        else f"{fmt.name} + fp32 scale per token and head"
    )


# ---- quantization ------------------------------------------------------------------------------
def quantize_kv(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (uint8 codes [..., D], fp32 scales [...]) with x ≈ code * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / fmt.qmax
    y = (x / scale.clamp_min(1e-30).unsqueeze(-1)).clamp_(-fmt.qmax, fmt.qmax)
    codes = y.round_().to(torch.int8) if fmt.code_dtype == torch.int8 else y.to(fmt.code_dtype)
    return codes.view(torch.uint8), scale


def dequantize_kv(
    codes: torch.Tensor, scale: torch.Tensor, fmt: KVFormat, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 codes [..., D] and scales [...] → values [..., D] in `dtype`."""
    if fmt.code_dtype == torch.int8:
        values = codes.view(torch.int8).float()
    else:  # a 256-entry table: ~4x faster than PyTorch's fp8 → fp32 conversion on the CPU
        table = _code_values(fmt.name, str(codes.device))
        values = table.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    return (values * scale.unsqueeze(-1)).to(dtype)


def _cpu_kernels():
    from inferd.kernels.quant_gemm import extension

    return extension()


@functools.cache
def _code_values(name: str, device: str) -> torch.Tensor:
    """fp32 value of each of the 256 codes of format `name`."""
    fmt = _FORMATS[name]
    return torch.arange(256, dtype=torch.uint8).view(fmt.code_dtype).float().to(device)


@dataclass(slots=True)
class QuantizedKV:
    """One layer's K (or V) when quantized: what attention receives instead of a plain tensor."""

    data: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] uint8 codes
    scale: torch.Tensor  # [num_blocks, block_size, kv_heads] fp32
    fmt: KVFormat

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Store x [T, kv_heads, D] at flat `slots`; returns x as stored (dequantized), so
        attention over this step's own K/V sees what later steps will read back."""
        _, _, h, d = self.data.shape
        codes, scale = quantize_kv(x, self.fmt)
        self.data.view(-1, h, d).index_copy_(0, slots, codes)
        self.scale.view(-1, h).index_copy_(0, slots, scale)
        return dequantize_kv(codes, scale, self.fmt, x.dtype)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks `blocks` [n] dequantized: [n, block_size, kv_heads, head_dim] in `dtype`."""
        return dequantize_kv(self.data.index_select(0, blocks), self.scale.index_select(0, blocks),
                             self.fmt, dtype)  # fmt: skip


LayerKV = torch.Tensor | QuantizedKV


class KVCache:
    """All layers' K/V over the block pool (see the module docstring for the layout)."""

    def __init__(self, data: torch.Tensor, kv_cache_dtype: str = "auto") -> None:
        """`data` comes zeroed from the runner's allocator, in `storage_dtype(...)`."""
        self.data = data
        self.fmt = kv_format(kv_cache_dtype)
        self.scales: torch.Tensor | None = None
        if kv_cache_dtype in _FLOAT_STORAGE and data.dtype != _FLOAT_STORAGE[kv_cache_dtype]:
            raise ValueError(f"a {kv_cache_dtype} KV cache stores {kv_cache_dtype}, got {data.dtype}")
        if self.fmt is not None:
            if data.dtype != torch.uint8:
                raise ValueError(f"a {self.fmt.name} KV cache stores uint8 codes, got {data.dtype}")
            # Zeroed: padded, masked slots are read too, and a garbage NaN scale would poison them.
            self.scales = torch.zeros(data.shape[:-1], dtype=torch.float32, device=data.device)

    storage_dtype = staticmethod(storage_dtype)

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)

    def layers(self, layer_slot: Sequence[int] | None = None) -> list[tuple[LayerKV, LayerKV]]:
        """Per layer (K, V): views of the pool, plain tensors or `QuantizedKV` (with one plane,
        MLA's latents, K and V are the same view). `layer_slot[l]`: the pool's first index layer
        l uses (KV cache groups, inferd/kv/kv_groups.py: layers of different groups share a slot
        and differ by block ids); default: layer l, slot l."""
        if layer_slot is None:
            layer_slot = range(self.data.shape[0])
        v_plane = self.data.shape[1] - 1
        if self.scales is None:
            return [(self.data[i, 0], self.data[i, v_plane]) for i in layer_slot]
        return [tuple(QuantizedKV(self.data[i, j], self.scales[i, j], self.fmt) for j in (0, v_plane))
                for i in layer_slot]  # fmt: skip

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Flat slots `src` → `dst` in every layer, K and V (scales too)."""
        ext = _cpu_kernels() if self.data.is_cpu else None
        if ext is not None:  # csrc/layer_ops.h: a few rows, where ATen's indexing costs ~90 µs
            ext.copy_slots(self.data, src, dst)
            if self.scales is not None:
                ext.copy_slots(self.scales, src, dst)
            return
        layers, two, blocks, bs = self.data.shape[:4]
        data = self.data.view(layers, two, blocks * bs, *self.data.shape[4:])
        data[:, :, dst] = data[:, :, src]
        if self.scales is not None:
            scales = self.scales.view(layers, two, blocks * bs, -1)
            scales[:, :, dst] = scales[:, :, src]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: blocks `src` → `dst` in every layer, K and V (scales too)."""
        self.data[:, :, dst] = self.data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]
