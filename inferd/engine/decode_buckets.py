"""Decode-only steps with fixed-shape metadata: the batch padded to a bucket size, its step
metadata living in persistent device buffers that each step fills in place.

A bucket of B rows reads, at fixed addresses, input ids [B], positions [B], slots [B], context
lengths [B] and block tables [B, W] (W: the blocks of a `max_model_len` sequence). Each step
writes them into one pinned host staging buffer and uploads them with one non-blocking copy; the
row starts (0..B-1) and query lengths (all 1) never change. Fixed addresses and shapes are what
a CUDA graph captured for the bucket replays (inferd/engine/cuda_graphs.py); on the CPU the same
path runs eagerly.

Padded rows (real rows [0, n), padding [n, B)) decode token 0 at position 0 into a scratch slot
that no sequence owns (`scratch_block`: one block past those the KV manager hands out) and attend
to that one key only; their logits are dropped. A row's arithmetic depends on that row alone, so the real
rows' tokens equal the unpadded step's.

The staging buffer is rewritten by the next step only after this step's sampled tokens were read
back (the step's one readback), by which time its upload has completed. Table entries past a
row's context are never read (the kernels stop at its context length); they are zeroed anyway.
"""

from __future__ import annotations

import torch

from inferd.layers.attention_plan import AttentionMetadata, PaddedGroup
from inferd.scheduler.sequence import Sequence

# Capture sizes as vLLM and SGLang choose them: small powers of two, then every multiple of 8.
MAX_BUCKET = 256


def bucket_sizes(max_num_seqs: int, cap: int = MAX_BUCKET) -> tuple[int, ...]:
    """Bucket sizes 1, 2, 4, 8, 16, 24, 32, ... up to the first that holds `max_num_seqs`, none
    above `cap`."""
    sizes = [1, 2, 4] + list(range(8, cap + 1, 8))
    limit = min(max_num_seqs, cap)
    upto = next(i for i, s in enumerate(sizes) if s >= limit or s == sizes[-1])
    return tuple(sizes[: upto + 1])


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `n` rows; None past the largest (the step runs unpadded)."""
    return next((s for s in sizes if s >= n), None)


class DecodeBuckets:
    """The persistent buffers of every bucket and each bucket's `AttentionMetadata` over them
    (built once: a captured graph holds its tensors' addresses)."""

    def __init__(
        self, sizes: tuple[int, ...], max_blocks: int, block_size: int, scratch_block: int,
        kernel, device: torch.device,
    ) -> None:  # fmt: skip
        self.sizes = sizes
        self.width = max_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        largest = self.largest = sizes[-1]
        # One buffer [ids L | positions L | slots L | context lengths L | tables L x W] (L: the
        # largest bucket); bucket B's fields are each field's first B rows, so a row is the same
        # memory in every bucket and the upload is the one range [0, 4L + B * W).
        n = largest * (4 + max_blocks)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=device.type == "cuda")
        self.device_buf = torch.zeros(n, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, dtype=torch.long, device=device)
        self.ones = torch.ones(largest, dtype=torch.long, device=device)
        self._views = {b: self._bucket_views(self.device_buf, b) for b in sizes}
        host_np = self.host.numpy()  # the pinned buffer's memory, written through numpy
        self._host_np = {b: self._bucket_views(host_np, b) for b in sizes}
        self._dirty = [0] * largest  # per row: the table entries last written
        self.uploads = 0  # host→device copies made (one per step)
        self.metas = {b: self._meta(b, kernel) for b in sizes}
        self.fill(largest, [], [])  # every row padding until a step fills it

    def _bucket_views(self, buf, b: int) -> tuple:
        """Bucket `b`'s (ids, positions, slots, context lengths, tables [b, W]) in `buf` (a
        tensor or the staging buffer's numpy view)."""
        big = self.largest
        ids, pos, slots, ctx = (buf[i * big : i * big + b] for i in range(4))
        tables = buf[4 * big : 4 * big + b * self.width].reshape(b, self.width)
        return ids, pos, slots, ctx, tables

    def _meta(self, b: int, kernel) -> AttentionMetadata:
        _, _, slots, ctx, tables = self._views[b]
        rows = self.rows[:b]
        group = PaddedGroup(token_rows=rows, padded_index=rows, block_tables=tables, mask=None,
                            q_max=1, is_whole_batch=False, kernel=kernel, row_start=rows,
                            q_lens=self.ones[:b], ctx_lens=ctx)  # fmt: skip
        return AttentionMetadata(slot_mapping=slots, block_size=self.block_size, group=None,
                                 prefills=[], kernel_group=group)  # fmt: skip

    def inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Bucket `b`'s input ids [b], positions [b] and plan, at their fixed addresses."""
        ids, pos, *_ = self._views[b]
        return ids, pos, self.metas[b]

    def fill(self, b: int, seqs: list[Sequence], tables: list[list[int]]) -> None:
        """Stage the decodes of `seqs` (block tables `tables`) as bucket `b`'s first rows, the rest
        padding, and upload them: one host→device copy, non-blocking from pinned memory."""
        n, bs = len(seqs), self.block_size
        ids, pos, slots, ctx, tab = self._host_np[b]
        dirty = self._dirty
        positions = [seq.num_computed_tokens for seq in seqs]
        ids[:n] = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
        pos[:n] = positions
        slots[:n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        ctx[:n] = [p + 1 for p in positions]
        ids[n:], pos[n:], slots[n:], ctx[n:] = 0, 0, self.scratch_block * bs, 1
        for i in range(b):
            if i < n:
                used = positions[i] // bs + 1  # blocks holding keys [0, p]
                tab[i, :used] = tables[i][:used]
            else:
                used = 1
                tab[i, 0] = self.scratch_block
            if dirty[i] > used:  # a longer table last time: its tail back to block 0
                tab[i, used : dirty[i]] = 0
            dirty[i] = used
        end = 4 * self.largest + b * self.width
        self.device_buf[:end].copy_(self.host[:end], non_blocking=True)
        self.uploads += 1
