"""Owns the model and the KV tensors; turns a `SchedulerOutput` into one forward pass.

The step's batch is flat: every scheduled sequence contributes tokens [num_computed, num_computed + n)
with their positions and cache slots. Only the rows whose sequence has no uncomputed tokens left
after this step (the end of a prefill, or a decode) produce logits. A decode verifying k draft
tokens contributes its last token followed by the drafts (q_len = 1 + k) and produces 1 + k rows
of logits: row i is the target's distribution after draft i (row 0: after the last real token).

The leaves of a draft tree (`seq.spec.leaves`: alternatives to the draft at some depth d) get rows
of their own after every sequence's rows, each attended as a one-query sequence of its own: keys
[0, p + d) of its sequence, then its own at position p + d (p: the last real token). That position
holds the chain's draft in the sequence's blocks, so the leaf's table swaps the block holding it
for a scratch block (`KVCacheManager.allocate_scratch`) with the same keys before it: those
computed earlier are copied in before the forward (`scratch_copies`), those of this step are
written twice (`AttentionMetadata.mirror_rows`). A leaf then sees exactly the keys a decode at its
position would, in the same places: its logits match one-at-a-time decoding bit for bit.

With several KV cache groups (inferd/kv/kv_groups.py: sliding-window layers apart from full ones),
every group has its own block tables, so its own slots and tables in the plan: the step builds one
`AttentionMetadata` per group over the same rows, and each layer attends with its group's.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import sys
from dataclasses import dataclass

import torch

from inferd.config import ModelConfig
from inferd.distributed.group import TPGroup
from inferd.engine.decode_buckets import DecodeBuckets, bucket_for, bucket_sizes
from inferd.engine.readbacks import HostReadbacks
from inferd.host_to_device import upload
from inferd.kv.connectors.base import KVConnectorBase, NullConnector
from inferd.kv.kv_cache import KVCache
from inferd.kv.kv_groups import KVLayout
from inferd.kv.prefault import KVPrefaulter
from inferd.layers.attention import AttentionMetadata, PaddedGroup, PrefillSlice, shared_prefix
from inferd.layers.moe import SparseMoE
from inferd.layers.quantized_linear import pack_quantized_weights
from inferd.layers.weight_arena import gather_weights
from inferd.models.interface import CausalLM
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence
from inferd.slow_paths import warn_slow_path

# Allocations this large come from a fresh anonymous mmap on Linux, which the kernel fills with
# zeros lazily; torch.zeros would touch every page up front (7 s for 4 GiB here). Smaller ones,
# and any CUDA pool, are zeroed explicitly: attention reads padded, masked slots, and 0 × NaN
# from garbage memory would poison the output.
_LAZY_ZERO_BYTES = 64 << 20

# Without a short-query kernel (the torch attention backend): queries up to this long share one
# padded attention call; longer prefill chunks run one sequence at a time, where padding would
# cost more than it saves.
PADDED_GROUP_MAX_QUERY = 32
# With one (the CPU backend), every query goes to it, a long one as entries of at most this many
# rows: the kernel keeps each entry's partial sums until it merges them, so this bounds that
# memory, and a row's result never depends on the entry it falls in.
KERNEL_PIECE_ROWS = 256


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    layers: int | None = None,
) -> torch.Tensor:
    """[layers, 2 (k/v; 1 where one plane serves as both: MLA), num_blocks, block_size, kv_heads,
    head_dim]; `layers`: the layers one block holds (a KV group's, inferd/kv/kv_groups.py), by
    default every layer of the model."""
    planes, heads, head_dim = cfg.kv_layout()
    shape = (layers or cfg.num_layers, planes, num_blocks, block_size, heads, head_dim)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if _maps_lazily(nbytes, device):
        # A mapping of its own, not torch.empty: malloc maps a large block afresh only when no
        # freed heap chunk fits, and a long-lived process (a test run making many engines) got a
        # recycled one, already resident and not zero. The tensor keeps the mapping alive.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def _maps_lazily(nbytes: int, device: torch.device) -> bool:
    return device.type == "cpu" and nbytes >= _LAZY_ZERO_BYTES and os.name == "posix"


def is_lazily_zeroed(data: torch.Tensor) -> bool:
    """`allocate_kv_cache` mapped this pool without touching it: pages fault on first write."""
    return _maps_lazily(data.numel() * data.element_size(), data.device)


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the flat batch whose logits the sampling sequences use
    sample_seqs: list[Sequence]
    # Per sampling sequence, how many consecutive sample_rows are its own: 1, or 1 + k drafts.
    sample_counts: list[int]
    # Every row's final hidden state, when `execute` was asked for them (a learned draft head),
    # followed by the outputs of the layers the model captures (`capture_layers`).
    hidden: torch.Tensor | None = None
    # Draft-tree leaves: per sequence id, its first row and its first leaf's; (src, dst) slots
    # copied before the forward into the leaves' scratch blocks (every layer).
    leaf_rows: dict[int, tuple[int, int]] | None = None
    scratch_copies: tuple[list[int], list[int]] | None = None


@dataclass(slots=True)
class StepPlan:
    """A step as plain lists (`ModelRunner.plan`): rows, per-KV-group slots, attention entries
    (first row, q_len, context after the step, block tables per KV group), the rows that sample,
    draft-tree leaves, and the KV copies to make before the forward."""

    input_ids: list[int]
    positions: list[int]
    slots: list[list[int]]
    group: list[tuple[int, int, int, list[list[int]]]]  # short queries, padded (no kernel)
    kernel_group: list[tuple[int, int, int, list[list[int]]]]
    prefills: list[tuple[int, int, int, list[list[int]]]]  # long chunks (no kernel)
    sample_rows: list[int]
    sample_seqs: list[Sequence]
    sample_counts: list[int]
    leaves: _LeafRows | None
    slot_copies: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    kv_high_water: int = 0
    # Per row, the LoRA slot of its sequence's adapter (-1: the base model); None: no adapted row.
    lora_slots: list[int] | None = None

    def for_workers(self) -> StepPlan:
        """The plan without its sequences (rank 0's scheduler state, which workers never read)."""
        return dataclasses.replace(self, sample_seqs=[])


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        use_attention_kernel: bool = True,
        kv_cache_dtype: str = "auto",
        kv_cache_prefault: int = 0,
        layout: KVLayout | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.model = model
        # Tensor parallelism: this runner is rank 0 of `tp`, whose other ranks (workers) run each
        # step's plan on their shards; `model` is rank 0's shard (its config its heads' and vocab
        # slice), `cfg` the whole model's.
        self.tp = tp
        self.vocab_size = cfg.vocab_size
        self.layout = layout or KVLayout.single(cfg.num_layers)
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache_prefault = kv_cache_prefault
        self.kv_prefaulter: KVPrefaulter | None = None
        # Device→host reads of the step (the sampler's and the verifier's): one per decode step.
        self.readbacks = HostReadbacks()
        # Decode-only steps padded to buckets, and their CUDA graphs (`enable_decode_buckets`).
        self.buckets: DecodeBuckets | None = None
        self.graphs = None
        self.bucket_steps = 0  # steps run in a bucket (graph replays or eager)
        # The KV connector's worker side (inferd/kv/connectors/base.py): `set_connector`.
        self.connector: KVConnectorBase = NullConnector(None, None)
        self._allocate_kv()
        # Every query goes to the kernel group where the model's attention backend has a paged
        # kernel (inferd/layers/attention.py); elsewhere the padded group and long chunks.
        self.attention_kernel = model.attention_backend.kernel if use_attention_kernel else None
        self.kernel_max_query = model.attention_backend.kernel_max_query or sys.maxsize
        if self.attention_kernel is None and use_attention_kernel:
            warn_slow_path(f"padded-attention-{device.type}", "no paged attention kernel for %s on %s: "
                           "every decode copies each sequence's whole context out of the KV pool "
                           "into a masked SDPA call", str(dtype).removeprefix("torch."), device.type)  # fmt: skip
        if device.type == "cpu" and dtype == torch.float32:
            pack_quantized_weights(model)  # int8 / int4 into the VNNI kernels' tiles, in place
        if device.type == "cpu":
            # One huge-page block in the layers' order (layers/weight_arena.py), before anything
            # (the fused step's weight list) captures the tensors.
            gather_weights([model])

    def _allocate_kv(self) -> None:
        storage = KVCache.storage_dtype(self.kv_cache_dtype, self.dtype)  # --kv-cache-dtype: kv/kv_cache.py
        # With decode buckets, one block past the KV manager's: the padded rows' scratch block.
        physical = self.num_blocks + (self.buckets is not None)
        data = allocate_kv_cache(self.model.config, physical, self.block_size, storage, self.device,
                                 self.layout.group_size)  # fmt: skip
        self.kv_cache = KVCache(data, self.kv_cache_dtype)
        self.kv_caches = self.kv_cache.layers(self.layout.layer_slot)
        self.connector.register_kv_cache(self.kv_cache)
        self.kv_prefaulter = None
        if self.kv_cache_prefault > 0 and is_lazily_zeroed(data):
            self.kv_prefaulter = KVPrefaulter(data, self.kv_cache_prefault)

    def wait_kv_prefault(self, timeout: float = 120.0) -> None:
        """Until the pool's first pages are faulted in (`KVPrefaulter`): a benchmark that starts
        traffic at once would otherwise time page faults that a server pays before its traffic."""
        if self.kv_prefaulter is not None:
            self.kv_prefaulter.wait(timeout)

    def resize_kv(self, num_blocks: int) -> None:
        """A pool of `num_blocks` in place of the current one (the start-up plan replaces the
        profiling pool); the caller guarantees no block is in use. Before
        `enable_decode_buckets`: the buckets' scratch block is the pool's last."""
        if self.buckets is not None:
            raise RuntimeError("resize the KV pool before enabling decode buckets")
        self.num_blocks = num_blocks
        self.release_kv_pages()

    def release_kv_pages(self) -> None:
        """Replace the KV pool with fresh memory (lazily zeroed where `allocate_kv_cache` maps it);
        the caller guarantees no block is in use. Start-up calibration writes and reads much of
        the pool with dummy sequences; a fresh pool keeps serving from starting on pages in that
        state (decoding ran measurably slower on them). With CUDA graphs captured, the pool is
        zeroed in place instead: the graphs hold its address."""
        if self.graphs is not None:
            self.kv_cache.data.zero_()
            return
        self.kv_cache = self.kv_caches = None  # drop the old pool before mapping the new one
        self._allocate_kv()

    def enable_decode_buckets(self, max_num_seqs: int, max_model_len: int, cuda_graphs: bool) -> None:
        """Run decode-only steps padded to bucket sizes over persistent inputs
        (inferd/engine/decode_buckets.py) and, with `cuda_graphs` on a CUDA device, replay a graph
        captured per bucket (inferd/engine/cuda_graphs.py). Needs the backend's paged kernel and
        one KV group (elsewhere steps stay as planned); reallocates the pool with its scratch
        block, so no block may be in use."""
        if self.attention_kernel is None or self.layout.num_groups != 1:
            return
        if any(isinstance(m, SparseMoE) for m in self.model.modules()):
            # Expert routing sizes each expert's rows on the host (no graph), and padded rows
            # would count in the experts' load statistics.
            warn_slow_path("decode-buckets-moe", "mixture-of-experts models decode eagerly, "
                           "without CUDA graphs")  # fmt: skip
            return
        sizes = bucket_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        self.buckets = DecodeBuckets(sizes, max_blocks, self.block_size, self.num_blocks,
                                     self.attention_kernel, self.device)  # fmt: skip
        self.release_kv_pages()  # the pool again, with the scratch block
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from inferd.engine.cuda_graphs import capture_decode_graphs

            with torch.inference_mode():
                self.graphs = capture_decode_graphs(self.buckets, self._bucket_forward, self.device)

    def _bucket_forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket `b`'s forward over its persistent inputs: (logits [b, V], hidden [b, H])."""
        ids, pos, meta = self.buckets.inputs(b)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        return self.model.compute_logits(hidden), hidden

    def decode_bucket(self, out: SchedulerOutput, all_hidden: bool) -> int | None:
        """The bucket a decode-only step runs in: every sequence decodes one token (no drafts to
        verify, no tree leaves, no prefill) and their number fits a bucket; else None."""
        if self.buckets is None or all_hidden:
            return None
        for seq, n in out.scheduled:
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.spec.leaves or seq.lora is not None:
                return None  # (an adapted row runs the unbucketed path: a graph has no LoRA delta)
        return bucket_for(len(out.scheduled), self.buckets.sizes)

    def _execute_bucket(self, out: SchedulerOutput, b: int) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
        """A decode-only step in bucket `b`: the real rows' logits and hidden states, padding's
        dropped."""
        seqs = [seq for seq, _ in out.scheduled]
        n = len(seqs)
        self.bucket_steps += 1
        self.buckets.fill(b, seqs, [tables[0] for tables in out.block_tables])
        ids, pos, meta = self.buckets.inputs(b)
        if self.graphs is not None and b in self.graphs:
            logits, hidden = self.graphs.replay(b)
            logits, hidden = logits[:n], hidden[:n]
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)[:n]
            logits = self.model.compute_logits(hidden)
        batch = StepBatch(ids[:n], pos[:n], meta, list(range(n)), seqs, [1] * n)
        return logits, hidden, batch

    def as_tensor(self, data: list[int]) -> torch.Tensor:
        """Indices (slots, rows, blocks) as an int64 tensor on the model's device (no host sync)."""
        return upload(data, self.device, torch.long)

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        return self.build(self.plan(out))

    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The step's rows, slots and attention entries as plain lists (what tensor-parallel
        ranks receive from rank 0: `build` makes the same batch from it anywhere)."""
        bs = self.block_size
        num_groups = self.layout.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        # Short queries go to the padded group: (first row, q_len, context after step, tables),
        # `tables` holding one block table per KV group.
        group: list[tuple[int, int, int, list[list[int]]]] = []
        kernel_group: list[tuple[int, int, int, list[list[int]]]] = []
        # Long chunks (no kernel): (first row, q_len, context after step, tables).
        prefills: list[tuple[int, int, int, list[list[int]]]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_counts: list[int] = []
        leaves = None
        if any(seq.spec.leaves for seq, _ in out.scheduled):
            leaves = _LeafRows(sum(n for _, n in out.scheduled), num_groups)
        for i, (seq, n) in enumerate(out.scheduled):
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            tables = out.block_tables[i]
            num_tokens = seq.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            if end > num_tokens:  # draft tokens to verify follow the last real token
                input_ids.extend(seq.spec.token_ids[: end - num_tokens])
            positions.extend(range(start, end))
            for g, table in enumerate(tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if self.attention_kernel is not None and n <= self.kernel_max_query:
                # Every query through the one kernel (up to the backend's kernel_max_query: the
                # CPU's takes all), so a row's attention has the same bits whatever its chunk (a
                # full prefill, a cache-hit suffix, a decode). Long queries go as pieces: entries
                # of the same sequence, each seeing its own keys.
                for a in range(0, n, KERNEL_PIECE_ROWS):
                    m = min(KERNEL_PIECE_ROWS, n - a)
                    ctx = start + a + m
                    kernel_group.append((row0 + a, m, ctx, [t[: (ctx + bs - 1) // bs] for t in tables]))
            elif self.attention_kernel is None and n <= PADDED_GROUP_MAX_QUERY:
                group.append((row0, n, end, [t[: (end + bs - 1) // bs] for t in tables]))
            else:
                prefills.append((row0, n, end, [t[: (end + bs - 1) // bs] for t in tables]))
            if end >= num_tokens:
                first = row0 + num_tokens - 1 - start
                sample_rows.extend(range(first, row0 + n))
                sample_seqs.append(seq)
                sample_counts.append(row0 + n - first + len(seq.spec.leaves))
                if seq.spec.leaves:
                    scratch = out.scratch[seq.seq_id]
                    sample_rows.extend(leaves.add(seq, row0, start, tables, scratch, bs))
        if leaves is not None:
            input_ids.extend(leaves.input_ids)
            positions.extend(leaves.positions)
            for g in range(num_groups):
                slots[g].extend(leaves.slots[g])
            target = kernel_group if self.attention_kernel is not None else group
            target.extend(leaves.entries)
        lora_slots = None
        if any(seq.lora is not None for seq, _ in out.scheduled):
            # Adapted sequences never speculate: no leaves among their rows, which come first.
            lora_slots = [s for seq, n in out.scheduled for s in [-1 if seq.lora is None else seq.lora.slot] * n]
            lora_slots += [-1] * (len(input_ids) - len(lora_slots))
        return StepPlan(input_ids, positions, slots, group, kernel_group, prefills, sample_rows,
                        sample_seqs, sample_counts, leaves, out.slot_copies, out.block_copies,
                        out.kv_high_water, lora_slots)  # fmt: skip

    def _prefill_mask(self, n: int, end: int) -> torch.Tensor | None:
        """A long chunk's mask: query i sits at position end - n + i and sees keys [0, that]."""
        start = end - n
        if start == 0:
            return None
        q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
        return torch.arange(end, device=self.device).unsqueeze(0) <= q_pos

    def build(self, plan: StepPlan) -> StepBatch:
        """The step's tensors and attention metadata from its plan."""
        bs = self.block_size
        num_groups = self.layout.num_groups
        input_ids, positions, slots, leaves = plan.input_ids, plan.positions, plan.slots, plan.leaves
        group, kernel_group, prefills = plan.group, plan.kernel_group, plan.prefills
        padded = self._padded_group(group, len(input_ids)) if group else [None] * num_groups
        kernel = self._padded_group(kernel_group, len(input_ids)) if kernel_group else [None] * num_groups
        slot_mappings = self.as_tensor(slots)  # [groups, T]: one tensor, a row per group
        masks = [self._prefill_mask(n, end) for _, n, end, _ in prefills]
        metas = [
            AttentionMetadata(
                slot_mapping=slot_mappings[g],
                block_size=bs,
                group=padded[g],
                prefills=[PrefillSlice(r, r + n, end, self.as_tensor(tables[g]), mask)
                          for (r, n, end, tables), mask in zip(prefills, masks)],
                kernel_group=kernel[g],
            )
            for g in range(num_groups)
        ]  # fmt: skip
        meta = metas[0]
        if num_groups > 1:
            meta.kv_groups = metas
            meta.layer_group = self.layout.layer_group
        batch = StepBatch(self.as_tensor(input_ids), self.as_tensor(positions), meta,
                          plan.sample_rows, plan.sample_seqs, plan.sample_counts)  # fmt: skip
        if leaves is not None:
            mirror_rows = self.as_tensor(leaves.mirror_rows)
            mirror_slots = self.as_tensor(leaves.mirror_slots)  # [groups, M]
            for g, m in enumerate(metas):
                m.mirror_rows = mirror_rows
                m.mirror_slots = mirror_slots[g]
            batch.leaf_rows = leaves.first_rows
            batch.scratch_copies = (leaves.copy_src, leaves.copy_dst)
        return batch

    def _padded_group(
        self, group: list[tuple[int, int, int, list[list[int]]]], num_rows: int
    ) -> list[PaddedGroup]:
        """The group's plan for each KV group: the same rows, each group's own block tables."""
        bs = self.block_size
        q_max = max(n for _, n, _, _ in group)
        width = max(len(t[0]) for *_, t in group)
        token_rows: list[int] = []
        padded_index: list[int] = []
        for b, (row0, n, _, _) in enumerate(group):
            token_rows.extend(range(row0, row0 + n))
            padded_index.extend(range(b * q_max, b * q_max + n))
        # [groups, B, width] in one tensor; group g's tables are its (contiguous) row g.
        tables = self.as_tensor([[t[g] + [0] * (width - len(t[g])) for *_, t in group]
                                 for g in range(self.layout.num_groups)]).unbind(0)  # fmt: skip
        q_len = self.as_tensor([n for _, n, _, _ in group])
        ctx = self.as_tensor([c for _, _, c, _ in group])
        token_rows_t, padded_index_t = self.as_tensor(token_rows), self.as_tensor(padded_index)
        if self.attention_kernel is not None:
            row_start = self.as_tensor([r for r, _, _, _ in group])
            return [PaddedGroup(
                token_rows=token_rows_t, padded_index=padded_index_t,
                block_tables=t, mask=None, q_max=q_max,
                is_whole_batch=False, kernel=self.attention_kernel,
                row_start=row_start, q_lens=q_len, ctx_lens=ctx,
            ) for t in tables]  # fmt: skip
        q_len, ctx = q_len.view(-1, 1, 1), ctx.view(-1, 1, 1)
        i = torch.arange(q_max, device=self.device).view(1, -1, 1)
        j = torch.arange(width * bs, device=self.device).view(1, 1, -1)
        # Query i of a sequence sits at position ctx - q_len + i and sees keys up to it. Padded
        # query rows (i >= q_len) see key 0 only: never an all-masked row (NaN), output dropped.
        mask = (j <= ctx - q_len + i) | ((i >= q_len) & (j == 0))
        whole = q_max == 1 and token_rows == list(range(num_rows))
        window_masks: dict[int, torch.Tensor] = {}  # the same rows in every group: shared
        return [
            PaddedGroup(
                token_rows=token_rows_t,
                padded_index=padded_index_t,
                block_tables=t,
                mask=mask.unsqueeze(1),
                q_max=q_max,
                is_whole_batch=whole,
                q_lens=q_len.view(-1),
                ctx_lens=ctx.view(-1),
                shared=shared_prefix([(n, c, ts[g]) for _, n, c, ts in group], q_max, bs, self.device),
                _window_masks=window_masks,
            )
            for g, t in enumerate(tables)
        ]

    def _copy_kv(self, plan: StepPlan | SchedulerOutput) -> None:
        """What the step moves in the KV pool before its forward (the prefault's high water,
        accepted tree leaves, copy-on-write blocks)."""
        if self.kv_prefaulter is not None:
            self.kv_prefaulter.advance(plan.kv_high_water)
        if plan.slot_copies:  # accepted draft-tree leaves, out of the last step's scratch blocks
            src, dst = zip(*plan.slot_copies)
            self.kv_cache.copy_slots(self.as_tensor(list(src)), self.as_tensor(list(dst)))
        if plan.block_copies:  # copy-on-write of shared blocks
            src, dst = zip(*plan.block_copies)
            self.kv_cache.copy_blocks(self.as_tensor(list(src)), self.as_tensor(list(dst)))

    def set_connector(self, connector: KVConnectorBase) -> None:
        """Move KV through `connector` around each step (its worker side)."""
        self.connector = connector
        connector.register_kv_cache(self.kv_cache)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, all_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
        """Run the step's forward pass; returns logits [len(sample_rows), vocab] (fp32) and the
        final hidden states of the same rows; with `all_hidden`, every row's in `batch.hidden`.
        The KV connector's loads come first (before any other write into the pool: the step may
        reuse a block whose evicted contents it saves), its saves after the forward."""
        connector, meta = self.connector, out.kv_connector_meta
        connector.start_load_kv(meta)
        for layer in range(len(self.kv_caches)):  # one forward over every layer: whole-block loads
            connector.wait_for_layer_load(layer)
        result = self._execute(out, all_hidden)
        for layer, kv in enumerate(self.kv_caches):
            connector.save_kv_layer(layer, kv, meta)
        connector.wait_for_save()
        return result

    def _execute(self, out: SchedulerOutput, all_hidden: bool) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
        # A decode-only step in a bucket (CUDA graphs; never under tensor parallelism) needs no
        # plan: its inputs are filled straight from the sequences.
        bucket = self.decode_bucket(out, all_hidden) if self.tp is None else None
        if bucket is not None:
            self._copy_kv(out)
            return self._execute_bucket(out, bucket)
        plan = self.plan(out)
        if self.tp is not None:  # the other ranks run the same step on their shards
            self.tp.broadcast_object(plan.for_workers())
        return self.run(plan, all_hidden)

    @torch.inference_mode()
    def run(self, plan: StepPlan, all_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
        """`execute` from the step's plan (a tensor-parallel worker's entry: it has no scheduler)."""
        self._copy_kv(plan)
        batch = self.build(plan)
        if batch.scratch_copies is not None and batch.scratch_copies[0]:
            self.kv_cache.copy_slots(*map(self.as_tensor, batch.scratch_copies))
        lora = self.model.lora_slots if plan.lora_slots is not None else None
        if lora is not None:
            lora.begin_step(self.as_tensor(plan.lora_slots), max(plan.lora_slots) + 1)
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        finally:
            if lora is not None:
                lora.end_step()
        if all_hidden:
            # A draft head reading more of the target: its captured layers' rows after each row's.
            captured = self.model.captured if self.model.capture_layers else ()
            batch.hidden = torch.cat([hidden, *captured], dim=-1) if captured else hidden
        if not batch.sample_rows:
            empty = hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
            return empty, hidden[:0], batch
        if batch.sample_rows == list(range(hidden.shape[0])):
            rows = hidden  # every row samples (pure decode): no gather
        else:
            rows = hidden[self.as_tensor(batch.sample_rows)]
        return self.model.compute_logits(rows), rows, batch


class _LeafRows:
    """The rows, keys and scratch-block copies of a step's draft-tree leaves (module docstring),
    placed after the step's `first_row` rows of scheduled sequences; slots and tables per KV
    group (the slot copies of every group in one list: a block id is one group's)."""

    def __init__(self, first_row: int, num_groups: int) -> None:
        self.next_row = first_row
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[list[int]] = [[] for _ in range(num_groups)]
        self.entries: list[tuple[int, int, int, list[list[int]]]] = []  # (row, 1, context, tables)
        self.mirror_rows: list[int] = []
        self.mirror_slots: list[list[int]] = [[] for _ in range(num_groups)]
        self.copy_src: list[int] = []
        self.copy_dst: list[int] = []
        self.first_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, first leaf row)

    def add(
        self, seq: Sequence, row0: int, start: int, tables: list[list[int]], scratch: list[list[int]],
        bs: int,
    ) -> range:
        """Rows for `seq`'s leaves; `row0`: the row of its last real token, at position `start`;
        `tables` / `scratch`: its block tables and leaf blocks, per KV group."""
        first = self.next_row
        self.first_rows[seq.seq_id] = (row0, first)
        for leaf, (depth, token) in enumerate(seq.spec.leaves):
            pos = start + depth
            base = pos - pos % bs  # the block's first position
            for q in range(base, pos):  # the keys before the leaf's in its block
                if q >= start:  # the last real token or a draft above the leaf: written there too
                    self.mirror_rows.append(row0 + q - start)
            for g, (table, blocks) in enumerate(zip(tables, scratch)):
                block = blocks[leaf]
                for q in range(base, pos):
                    if q < start:  # computed in an earlier step: copied in before the forward
                        self.copy_src.append(table[q // bs] * bs + q % bs)
                        self.copy_dst.append(block * bs + q % bs)
                    else:
                        self.mirror_slots[g].append(block * bs + q % bs)
                self.slots[g].append(block * bs + pos % bs)
            self.input_ids.append(token)
            self.positions.append(pos)
            self.entries.append((self.next_row, 1, pos + 1, [t[: pos // bs] + [b[leaf]] for t, b in zip(tables, scratch)]))
            self.next_row += 1
        return range(first, self.next_row)
