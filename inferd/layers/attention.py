"""Attention over a step's ragged batch (the plan: inferd/layers/attention_plan.py), through a
backend chosen once at load.

An `AttentionBackend` owns every kernel choice attention makes: which kernel takes the kernel
group's short queries, which takes long prefill chunks. The model's layers call its `forward`
and nothing else; `select_attention_backend` picks it from the device, the dtype and whether the
C++ kernels build here, and `ATTENTION_BACKENDS` names every backend:
- "cpu" (fp32 on the CPU with the C++ kernels): the paged kernel (csrc/paged_attention.h), which
  reads K/V in place, codes included, takes every query the model runner plans (one kernel, so a
  row's bits never depend on how its prompt was split). Long chunks planned without the kernel
  group (a runner built with `use_attention_kernel=False`) go to the causal kernel
  (csrc/prefill_attention.h) at head size 64, SDPA at other head sizes.
- "triton" (CUDA with triton installed): the Triton paged kernel for short queries (decodes,
  verification rows, tree leaves), SDPA for long chunks (inferd/kernels/triton);
- "torch" (anywhere else): PyTorch's SDPA; no short-query kernel, so the runner puts every short
  query in the padded group (one gather + SDPA call, or cascade attention when its sequences
  share a prefix) and long chunks one sequence at a time.

A quantized cache (`--kv-cache-dtype int8|fp8`, inferd/kv/kv_cache.py) arrives as `QuantizedKV`:
K/V are quantized as they are written and dequantized as they are read. A float16 / bfloat16
cache is a plain tensor narrower than the queries: K/V are rounded as written and widened as
read. Either way a chunk without earlier context attends to its own K/V *as stored*, so every
path sees the same values whatever the chunking.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from inferd.host_to_device import upload
from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.kv.kv_cache import LayerKV, QuantizedKV
from inferd.layers.attention_plan import (
    CASCADE_MIN_SHARED_TOKENS,
    FLASH_ATTENTION_CPU,
    AttentionMetadata,
    PaddedGroup,
    PrefillSlice,
    SharedPrefix,
    shared_prefix,
)
from inferd.slow_paths import warn_slow_path

__all__ = [
    "ATTENTION_BACKENDS",
    "CASCADE_MIN_SHARED_TOKENS",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuKernelAttention",
    "PaddedGroup",
    "PrefillSlice",
    "SharedPrefix",
    "TorchAttention",
    "TritonAttention",
    "attend",
    "paged_attention",
    "select_attention_backend",
    "shared_prefix",
]

# The head size csrc/prefill_attention.h is built for.
PREFILL_KERNEL_HEAD_DIM = 64


def _gather(cache: LayerKV, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [n] of one layer's K or V → [n, block_size, kv_heads, D] (index_select: far cheaper
    than 2-D advanced indexing)."""
    if isinstance(cache, QuantizedKV):
        return cache.gather(blocks, dtype)
    return cache.index_select(0, blocks).to(dtype)


def _cascade_attention(
    q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, g: PaddedGroup, scale: float
) -> torch.Tensor:
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
    o1, lse1 = FLASH_ATTENTION_CPU(rows.transpose(0, 1).unsqueeze(0), kp, vp, scale=scale)
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
    o2, lse2 = FLASH_ATTENTION_CPU(qs, ks, vs, attn_mask=sp.mask, scale=scale)
    o2 = o2.transpose(1, 2).reshape(b * g.q_max, n_heads, d)
    lse2 = lse2.transpose(1, 2).reshape(b * g.q_max, n_heads)
    if not uniform:
        o2, lse2 = o2.index_select(0, g.padded_index), lse2.index_select(0, g.padded_index)
    # 3) Exact merge: the softmax over both key sets weighs each part by its share of the mass,
    # exp(lse1) / (exp(lse1) + exp(lse2)) = sigmoid(lse1 - lse2) for the shared part.
    o1, lse1 = o1[0].transpose(0, 1), lse1[0].transpose(0, 1)  # [N, Hq, D], [N, Hq]
    return torch.lerp(o2, o1, torch.sigmoid(lse1 - lse2).unsqueeze(-1).to(o1.dtype))


def _padded_group_attention(
    q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, g: PaddedGroup, scale: float, gqa: bool,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """The padded group's rows [N, Hq, D] (all T rows in order when `g.is_whole_batch`). A layer
    with a window or soft-capping takes the plain padded call (cascade attention merges two
    softmaxes over all shared keys, which neither allows)."""
    if g.shared is not None and window is None and softcap is None:
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
        rows = q.index_select(0, g.token_rows)
        qp = q.new_zeros(b * g.q_max, n_heads, d).index_copy_(0, g.padded_index, rows)
    qp = qp.view(b, g.q_max, n_heads, d).transpose(1, 2)  # [B, Hq, Qmax, D]
    mask = g.mask if window is None else g.window_mask(window)
    o = attend(qp, keys, vals, mask, scale, softcap)
    o = o.transpose(1, 2).reshape(b * g.q_max, n_heads, d)
    return o if g.is_whole_batch else o.index_select(0, g.padded_index)


def attend(
    q: torch.Tensor,  # [B, Hq, Q, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [B or 1, 1, Q, S] bool (True: may attend); None: causal, Q == S
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention by SDPA; with soft-capping (scores → cap · tanh(scores / cap) before the mask
    and softmax, as Gemma 2 computes them), eagerly. Returns [B, Hq, Q, D]."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, s = q.shape[-2], k.shape[-2]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), -1).to(q.dtype), v)


def window_mask(q_start: int, n: int, s: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, s] bool: query i (at position q_start + i) may attend key j, j in (pos - window, pos]."""
    pos = torch.arange(q_start, q_start + n, device=device).unsqueeze(1)
    j = torch.arange(s, device=device).unsqueeze(0)
    return (j <= pos) & (j > pos - window)


def _write(cache: LayerKV, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [n, Hkv, D] into flat `slots`, as stored (quantized, or rounded to a 2-byte cache)."""
    if isinstance(cache, QuantizedKV):
        cache.write(slots, x)
    else:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


class AttentionBackend(ABC):
    """One layer's attention over a step: `forward` stores the step's K/V, then attends each part
    of the plan (kernel group, padded group, long chunks) with this backend's kernels. Stateless
    past construction: one instance serves every layer."""

    name: ClassVar[str]
    # The module whose paged kernel takes the kernel group's short queries (the C++ extension,
    # or the Triton kernels' module); None: the backend has none, and the runner forms no kernel
    # group (nor can the fused decode step run).
    kernel: ModuleType | None = None
    # Longest query the kernel group takes whole or in pieces (None: every query); longer ones
    # are prefill chunks attended by `chunk`.
    kernel_max_query: int | None = None

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend's kernels run for a model of `dtype` on `device` here."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: LayerKV,  # [num_blocks, block_size, Hkv, D]
        v_cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend; returns [T, Hq, D]. A query at
        position p sees keys (p - window, p] (all up to p when `window` is None); with `softcap`
        its scores are soft-capped before the softmax."""
        _, _, n_kv, d = k_cache.shape
        if meta.mirror_rows is not None:  # before k and v are replaced by what is stored
            _write(k_cache, meta.mirror_slots, k.index_select(0, meta.mirror_rows))
            _write(v_cache, meta.mirror_slots, v.index_select(0, meta.mirror_rows))
        if isinstance(k_cache, QuantizedKV):
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
            self.short_queries(q, k_cache, v_cache, kg, out, scale, window, softcap)
            if meta.group is None and not meta.prefills:
                return out
        g = meta.group
        if g is not None:
            o = _padded_group_attention(q, k_cache, v_cache, g, scale, gqa, window, softcap)
            if g.is_whole_batch:
                return o
            out = (torch.empty_like(q) if out is None else out).index_copy_(0, g.token_rows, o)
        elif out is None:
            out = torch.empty_like(q)
        for p in meta.prefills:
            rows = slice(p.start, p.end)
            if p.mask is None:  # no earlier context: the chunk's own keys, plain causal
                self.chunk(q[rows], k[rows], v[rows], None, out[rows], scale, window, softcap)
            else:
                self.context_chunk(q[rows], k_cache, v_cache, p, out[rows], scale, window, softcap)
        return out

    def context_chunk(
        self, q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, p: PrefillSlice,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        """A long chunk after cached context (its K/V already written): q [n, Hq, D] against
        every key of its sequence, causal shifted by the context, into `out` [n, Hq, D]. Here:
        the keys gathered out of the pool for `chunk`."""
        _, block_size, n_kv, d = k_cache.shape
        n = p.block_table.numel()
        kp = _gather(k_cache, p.block_table, q.dtype).view(n * block_size, n_kv, d)
        vp = _gather(v_cache, p.block_table, q.dtype).view(n * block_size, n_kv, d)
        self.chunk(q, kp[: p.context_len], vp[: p.context_len], p.mask, out, scale, window, softcap)

    def short_queries(
        self, q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, g: PaddedGroup,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        """The kernel group's rows of `out` [T, Hq, D], K/V read from the cache."""
        raise NotImplementedError(f"attention backend {self.name!r} has no short-query kernel")

    def chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        """One long chunk: q [n, Hq, D] against k, v [S, Hkv, D] (S >= n, the chunk's queries
        last) under `mask` [n, S] (None: plain causal), into `out` [n, Hq, D]; with a `window`,
        query i (at key position S - n + i) sees only the last `window` keys up to its own."""
        if window is not None:
            n, s = q.shape[0], k.shape[0]
            mask = window_mask(s - n, n, s, window, q.device)
        qp = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kp, vp = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = attend(qp, kp, vp, mask, scale, softcap)
        out.copy_(o.squeeze(0).transpose(0, 1))


# Query rows one paged-kernel call takes at most: it holds every row's partial sums per 256-key
# split until it merges them, ~2.3 KB a row and split at the default model's sizes.
KERNEL_CALL_ROWS = 512


def _entry_slices(g: PaddedGroup) -> list[tuple[int, int]]:
    """The kernel group's entries in runs of at most KERNEL_CALL_ROWS query rows (one run for a
    step of decodes). Each row's result is the same in any run: entries are independent."""
    n = g.row_start.numel()
    if g.token_rows.numel() <= KERNEL_CALL_ROWS:
        return [(0, n)]
    runs, a, rows = [], 0, 0
    for i, q_len in enumerate(g.q_lens.tolist()):
        if rows and rows + q_len > KERNEL_CALL_ROWS:
            runs.append((a, i))
            a, rows = i, 0
        rows += q_len
    runs.append((a, n))
    return runs


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make `cls` selectable by its `name`."""
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


@register
class CpuKernelAttention(AttentionBackend):
    """fp32 on the CPU: the C++ paged kernel for the kernel group (every query, as the runner
    plans it); the causal kernel for long chunks at its head size (SDPA at others)."""

    name = "cpu"

    def __init__(self, head_dim: int) -> None:
        self.kernel = cpu_kernels()
        if self.kernel is None:
            raise RuntimeError("the CPU kernels are not available here")
        if head_dim == PREFILL_KERNEL_HEAD_DIM:
            self.chunk = self._chunk_kernel  # type: ignore[method-assign]

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and cpu_kernels() is not None

    def short_queries(
        self, q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, g: PaddedGroup,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        q = q.contiguous()
        w, cap = window or 0, softcap or 0.0  # the kernel's "none"
        runs = _entry_slices(g)
        for a, b in runs:
            starts, q_lens, ctx_lens, tables = (
                (g.row_start, g.q_lens, g.ctx_lens, g.block_tables) if len(runs) == 1 else
                (g.row_start[a:b], g.q_lens[a:b], g.ctx_lens[a:b], g.block_tables[a:b]))  # fmt: skip
            if isinstance(k_cache, QuantizedKV):  # the codes and scales in place
                self.kernel.paged_attention_short_quant(
                    q, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                    k_cache.fmt.kernel_code, starts, q_lens, ctx_lens, tables, out, scale, w, cap,
                )  # fmt: skip
            else:
                self.kernel.paged_attention_short(q, k_cache, v_cache, starts, q_lens, ctx_lens,
                                                  tables, out, scale, w, cap)  # fmt: skip

    def _chunk_kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        if window is not None or softcap is not None:  # the kernel is plain causal
            return AttentionBackend.chunk(self, q, k, v, mask, out, scale, window, softcap)
        # The kernel's causal mask is the chunk's queries last among the keys: `mask` says that.
        self.kernel.prefill_attention(q, k, v, out, scale)


@register
class TorchAttention(AttentionBackend):
    """PyTorch's SDPA for everything (CUDA, bf16 / fp16, no C++ compiler, the reference the
    kernels are tested against)."""

    name = "torch"

    def __init__(self, head_dim: int) -> None:
        del head_dim  # SDPA takes any

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True


@register
class TritonAttention(TorchAttention):
    """CUDA with triton installed (`inferd[gpu]`): the Triton paged kernel
    (inferd/kernels/triton/paged_attention.py) takes short queries (decodes, 1 + k verification,
    tree leaves) and long chunks after cached context straight from the pool, float or
    quantized; chunks without earlier context stay on SDPA (flash, `is_causal`). Head sizes the kernel lacks
    (not a power of two, or above 256) run as the torch backend, with one warning."""

    name = "triton"
    kernel_max_query = 32  # longer queries are prefill chunks: SDPA

    def __init__(self, head_dim: int) -> None:

        if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
            warn_slow_path(f"triton-attention-head-{head_dim}",
                           f"no Triton attention kernel for head size {head_dim}: padded SDPA over "
                           "gathered K/V")  # fmt: skip
            self.kernel = None
            return
        from inferd.kernels.triton import paged_attention

        self.kernel = paged_attention

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        from inferd.kernels import triton as triton_kernels

        return device.type == "cuda" and dtype in _TRITON_DTYPES and triton_kernels.available()

    def short_queries(
        self, q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, g: PaddedGroup,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        k_cache, v_cache, quant = _pool_arguments(k_cache, v_cache)
        self.kernel.paged_attention_short(
            q, k_cache, v_cache, g.row_start, g.q_lens, g.ctx_lens, g.block_tables, out, scale,
            g.q_max, g.token_rows, window=window, softcap=softcap, **quant,
        )  # fmt: skip

    def context_chunk(
        self, q: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV, p: PrefillSlice,
        out: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        """The same kernel as one entry of query tiles, reading the context in place."""
        if self.kernel is None:
            return super().context_chunk(q, k_cache, v_cache, p, out, scale, window, softcap)
        n = p.end - p.start
        if p.kernel_entry is None:
            p.kernel_entry = upload([0, n, p.context_len], q.device, torch.long)
        e = p.kernel_entry
        k_cache, v_cache, quant = _pool_arguments(k_cache, v_cache)
        self.kernel.paged_attention_short(
            q, k_cache, v_cache, e[0:1], e[1:2], e[2:3], p.block_table.view(1, -1), out, scale,
            n, e, window=window, softcap=softcap, prefill=True, **quant,
        )  # fmt: skip


def _pool_arguments(k_cache: LayerKV, v_cache: LayerKV) -> tuple:
    """(K data, V data, the kernel's quantization keywords) of one layer's pool."""
    if isinstance(k_cache, QuantizedKV):  # the codes and scales in place
        quant = {"k_scale": k_cache.scale, "v_scale": v_cache.scale,
                 "kv_format": k_cache.fmt.kernel_code}  # fmt: skip
        return k_cache.data, v_cache.data, quant
    return k_cache, v_cache, {}


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# First supported wins.
_PREFERENCE = ("cpu", "triton", "torch")


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int, name: str | None = None
) -> AttentionBackend:
    """The backend `name` names, or the first of "cpu", "triton", "torch" that runs for a model of
    `dtype` on `device` here."""
    if name is None:
        name = next(n for n in _PREFERENCE if ATTENTION_BACKENDS[n].supports(device, dtype))
        if name == "torch" and device.type == "cuda":

            warn_slow_path(
                f"padded-attention-{device.type}-{dtype}",
                f"attention on {device.type} ({dtype}) gathers every context out of the pool for "
                "SDPA (install inferd[gpu] for the Triton paged kernel)",
            )
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        known = ", ".join(ATTENTION_BACKENDS)
        raise ValueError(f"unknown attention backend {name!r} (known: {known})")
    if not cls.supports(device, dtype):
        raise ValueError(f"attention backend {name!r} does not run {dtype} on {device.type} here")
    return cls(head_dim)


@functools.cache
def _default_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    return select_attention_backend(device, dtype, head_dim)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV,
    meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """`AttentionBackend.forward` of the backend selected for q's device, dtype and head size:
    for callers holding no model (tests, tools). Returns [T, Hq, D]."""
    backend = _default_backend(q.device, q.dtype, q.shape[-1])
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
