"""Owns the model and the KV tensors; turns a `SchedulerOutput` into one forward pass.

The step's batch is flat: every scheduled sequence contributes tokens [num_computed, num_computed + n)
with their positions and cache slots. Only the rows whose sequence has no uncomputed tokens left
after this step (the end of a prefill, or a decode) produce logits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from inferd.config import ModelConfig
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.layers.attention import AttentionMetadata, PrefillSlice
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence

# Allocations this large come from fresh anonymous mmap on Linux (above glibc's mmap threshold),
# which the kernel fills with zeros lazily; torch.zeros would touch every page up front (7 s for
# 4 GiB here). Smaller ones, and any CUDA pool, are zeroed explicitly: attention reads padded,
# masked slots, and 0 × NaN from garbage memory would poison the output.
_LAZY_ZERO_BYTES = 64 << 20


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[layers, 2 (k/v), num_blocks, block_size, kv_heads, head_dim]"""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu" and nbytes >= _LAZY_ZERO_BYTES and os.name == "posix":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the flat batch whose logits each sampling sequence uses
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        kv: KVCacheManager,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.kv = kv
        self.device = device
        self.dtype = dtype
        self.block_size = kv.block_size
        self.kv_cache = allocate_kv_cache(cfg, kv.pool.num_blocks, kv.block_size, dtype, device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            table = self.kv.block_tables[seq.seq_id]
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decode_rows.append(row0)
                decode_tables.append(table[: (end + bs - 1) // bs])
                decode_lens.append(end)
            else:
                mask = None
                if start > 0:
                    # query i sits at position start + i and sees keys [0, start + i].
                    q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
                    mask = torch.arange(end, device=self.device).unsqueeze(0) <= q_pos
                block_table = self._tensor(table[: (end + bs - 1) // bs])
                prefills.append(PrefillSlice(row0, row0 + n, end, block_table, mask))
            if end == seq.num_tokens:
                sample_rows.append(row0 + n - 1)
                sample_seqs.append(seq)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_size=bs,
            decode_rows=None,
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            lens = self._tensor(decode_lens)
            meta.decode_rows = self._tensor(decode_rows)
            meta.decode_block_tables = self._tensor(padded)
            key_pos = torch.arange(width * bs, device=self.device)
            meta.decode_mask = (key_pos.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            meta.decode_is_whole_batch = len(decode_rows) == len(input_ids)
        return StepBatch(self._tensor(input_ids), self._tensor(positions), meta, sample_rows,
                         sample_seqs)  # fmt: skip

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, StepBatch]:
        """Run the step's forward pass; returns logits [num_sampling_seqs, vocab] (fp32)."""
        copies = self.kv.take_pending_copies()
        if copies:
            src = self._tensor([s for s, _ in copies])
            dst = self._tensor([d for _, d in copies])
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        batch = self.prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_rows:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32), batch
        logits = self.model.compute_logits(hidden[self._tensor(batch.sample_rows)])
        return logits, batch
