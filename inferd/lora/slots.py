"""The adapters a step runs, in `max_loras` slots, and the batched delta every adapted linear adds.

Each site (layer × qkv / o / gate_up / down) keeps the slots' A and B side by side:

    A [in, S·P·R]    B [S·P·R, out]     S slots, P parts of the site, R = --max-lora-rank

slot s, part p in columns (rows of B) [(s·P + p)·R, (s·P + p)·R + r_p), zero beyond r_p, its B
rows writing only the part's output columns. A step gives each token row its slot (-1: the base
model), and every site then adds, for all rows at once,

    delta = ((x @ A) * mask_P) @ B        mask_P [T, S·P·R] = 1 where the column's slot is the row's

— the gather-by-row of Punica's BGMV written as two dense matmuls and a mask: a base row's mask
is all zero, so its delta is exactly zero, and a row's delta reads its own slot only. The delta is
fp32 on the activation whatever the base linear is (dense, packed quantized, bf16 on CUDA). A
step runs it over the columns of slots [0, last slot of its rows] only (A's first columns, B's
first rows): the columns beyond would be zero. The fused C++ decode step (csrc/decoder_layers.h)
adds the same delta with the same ops from the same masks.

`begin_step(slots)` / `end_step()` bracket the forward that runs them (ModelRunner.run); between
steps no site adds anything. Slots are reused least recently used first (`assign`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from inferd.config import ModelConfig
from inferd.lora.adapter import SITE_PARTS, LoRAAdapter, LoRAError, site_shapes


class LoRASite:
    """One adapted linear's slot stacks; `add(x, y)` is y + the step's delta (y: the base output)."""

    __slots__ = ("a", "b", "parts", "slots")

    def __init__(
        self, slots: LoRASlots, width: int, out: int, parts: int, device: torch.device
    ) -> None:
        cols = slots.num_slots * parts * slots.max_rank
        self.a = torch.zeros(width, cols, device=device)
        self.b = torch.zeros(cols, out, device=device)
        self.parts = parts
        self.slots = slots

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        masks = self.slots.masks
        if masks is None:  # no adapted row this step
            return y
        mask = masks[self.parts]  # [T, C]: the columns of the slots up to the step's last
        cols = mask.shape[1]
        xf = x if x.dtype == torch.float32 else x.float()
        # (csrc/decoder_layers.h adapted_linear runs these ops in this order: the same bits)
        u = (xf @ self.a[:, :cols]).mul_(mask)
        if y.dtype == torch.float32:
            return torch.addmm(y, u, self.b[:cols])
        return y + (u @ self.b[:cols]).to(y.dtype)

    def write(self, slot: int, parts: list, rank: int) -> None:
        """Slot `slot` holds `parts` [(part index, LoRAPart)] (none: zero)."""
        width = self.parts * rank
        lo = slot * width
        self.a[:, lo : lo + width].zero_()
        self.b[lo : lo + width].zero_()
        for index, part in parts:
            c = lo + index * rank
            r = part.a.shape[0]
            self.a[:, c : c + r].copy_(part.a.t())
            self.b[c : c + r, part.offset : part.offset + part.b.shape[0]].copy_(part.b.t())


class LoRASlots:
    """The slot stacks of every adapted site of one model and the step's row → slot mapping."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_slots: int, max_rank: int,
                 device: torch.device) -> None:  # fmt: skip
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, device
        self.masks: dict[int, torch.Tensor] | None = None  # per part count; None between steps
        self.adapters: list[LoRAAdapter | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        # The slot of each column of a site with P parts: [S·P·R].
        self._column_slot = {
            p: torch.arange(num_slots, device=device).repeat_interleave(p * max_rank)
            for p in set(SITE_PARTS.values())
        }
        self.sites: dict[tuple[int, str], LoRASite] = {}
        shapes = site_shapes(cfg)
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(attn, "qkv_lora") or not hasattr(mlp, "gate_up_lora"):
                raise LoRAError(f"--enable-lora: {cfg.architecture} layers (mixture-of-experts or "
                                "latent attention) take no LoRA adapters")  # fmt: skip
            for site, owner in (("qkv", attn), ("o", attn), ("gate_up", mlp), ("down", mlp)):
                width, outs = shapes[site]
                s = LoRASite(self, width, sum(o for _, o in outs), SITE_PARTS[site], device)
                self.sites[(i, site)] = s
                setattr(owner, f"{site}_lora", s)

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for s in self.sites.values())

    def assign(self, adapters: list[LoRAAdapter]) -> None:
        """Put every adapter of `adapters` (at most num_slots distinct) in a slot, evicting the
        least recently used adapters not among them."""
        wanted = {id(a) for a in adapters}
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"{len(wanted)} adapters in one step, {self.num_slots} slots")
        for adapter in adapters:
            if adapter.slot >= 0 and self.adapters[adapter.slot] is adapter:
                self._lru.move_to_end(adapter.slot)
                continue
            slot = next(
                s
                for s in self._lru
                if self.adapters[s] is None or id(self.adapters[s]) not in wanted
            )
            old = self.adapters[slot]
            if old is not None:
                old.slot = -1
            for key, site in self.sites.items():
                site.write(slot, adapter.parts.get(key, []), self.max_rank)
            self.adapters[slot] = adapter
            adapter.slot = slot
            self._lru.move_to_end(slot)

    def drop(self, adapter: LoRAAdapter) -> None:
        """Free the adapter's slot (its weights stay until another adapter takes it)."""
        if adapter.slot >= 0 and self.adapters[adapter.slot] is adapter:
            self.adapters[adapter.slot] = None
            self._lru.move_to_end(adapter.slot, last=False)
        adapter.slot = -1

    def begin_step(self, row_slots: torch.Tensor, used: int | None = None) -> None:
        """The step's slot per token row [T] (-1: base model): every site adds its delta. `used`
        (one past the highest slot of a row; default all): the delta runs over the columns of
        slots [0, used) only, the rest being zero for every row this step."""
        rows = row_slots.view(-1, 1)
        width = self.max_rank * (self.num_slots if used is None else used)
        cols = self._column_slot
        self.masks = {p: (col[: p * width].view(1, -1) == rows).float() for p, col in cols.items()}

    def end_step(self) -> None:
        self.masks = None
