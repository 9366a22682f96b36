"""A step's attention plan over a ragged batch: which rows attend how, built once per step by the
model runner and shared by all layers (`AttentionMetadata`).

New K/V go into the block pool through a slot mapping; attention reads every sequence's context
back through its block table. Three shapes cover every scheduler choice:
- the kernel group: where the attention backend has a short-query kernel (the C++ paged kernel on
  the CPU, which reads K/V in place), every query goes to it, a long one as entries of a bounded
  number of rows (the model runner's KERNEL_PIECE_ROWS). One kernel for every query makes a row's
  attention the same bits whatever else the step holds and however its prompt was split (a full
  prefill, a prefix-cache hit's suffix, a chunk, a decode): with int8 activations a last-bit
  difference there grows into different tokens;
- without one (the torch backend), a padded group: short queries run as ONE attention call:
  queries padded to [B, Hq, Qmax, D], keys gathered from their blocks to [B, Hkv, L, D], one mask
  [B, 1, Qmax, L] that is causal, shifted by each sequence's context, and cut at its length.
  Per-sequence Python work would otherwise dominate steps of many short prompts;
- and there, long prefill chunks run one sequence at a time (padding them would waste more than
  it saves): with no earlier context, keys come straight from the chunk under a plain causal mask;
  otherwise from the cache under the shifted causal mask (chunked prefill, prefix-cache hits,
  recomputation).

When every sequence of a padded group starts with the same cached blocks (prefix-cache hits: one
system prompt, a shared document), the group runs as cascade attention (`SharedPrefix`): the shared
keys are attended once for all queries, each sequence's own keys in a small padded call, and the two
partial softmaxes merge exactly through their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch


@dataclass(slots=True)
class PrefillSlice:
    start: int  # [start, end) rows of the flat token batch
    end: int
    context_len: int  # tokens in the cache after this step, including this chunk
    block_table: torch.Tensor  # [num_blocks_for_context] int64
    # [q_len, context_len] bool (True = may attend); None when the chunk has no earlier context,
    # in which case keys come straight from this chunk with a plain causal mask.
    mask: torch.Tensor | None
    # (0, q_len, context_len) int64 on the device, for a paged kernel that reads the chunk's
    # context in place (the Triton backend): made by the first layer that asks, then shared.
    kernel_entry: torch.Tensor | None = None


@dataclass(slots=True)
class SharedPrefix:
    """Leading blocks that every sequence of a padded group shares, all before any of its queries.

    Key positions [0, P * block_size) come from `blocks` for everyone; a sequence's keys from
    P * block_size on come from its row of `rest_tables`. Gathering the shared keys once instead of
    once per sequence, and scoring all queries against them in one mask-free call (one large matrix
    product instead of B small ones), is what the split saves."""

    blocks: torch.Tensor  # [P] int64
    rest_tables: torch.Tensor  # [B, R] int64 (padding points at block 0, masked)
    # [B, 1, q_max, R * block_size] float: 0 where query i of sequence b may see rest key j, -inf
    # elsewhere. Padded query rows (i >= q_len) see rest key 0 at least (never an all -inf row,
    # whose softmax is NaN); their output is dropped.
    mask: torch.Tensor


# Cascade only pays when the shared part is long enough to outweigh a second attention call.
CASCADE_MIN_SHARED_TOKENS = 128
# The exact split needs each part's log-sum-exp: PyTorch's CPU flash kernel returns it.
FLASH_ATTENTION_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def shared_prefix(
    seqs: list[tuple[int, int, list[int]]], q_max: int, block_size: int, device: torch.device
) -> SharedPrefix | None:
    """The cascade plan for a padded group of (q_len, context after the step, block table), or None
    when its sequences share too little (or the device has no LSE-returning attention kernel)."""
    if len(seqs) < 2 or device.type != "cpu" or FLASH_ATTENTION_CPU is None:
        return None
    first = seqs[0][2]
    # Only blocks wholly before every sequence's first query: those hold no key written this step.
    shared = min((ctx - n) // block_size for n, ctx, _ in seqs)
    for _, _, table in seqs[1:]:
        k = 0
        while k < shared and table[k] == first[k]:
            k += 1
        shared = k
    if shared * block_size < CASCADE_MIN_SHARED_TOKENS:
        return None
    rest = [table[shared:] for _, _, table in seqs]
    width = max(len(t) for t in rest)
    padded = [t + [0] * (width - len(t)) for t in rest]
    tables = torch.tensor(padded, dtype=torch.long, device=device)
    q_len = torch.tensor([n for n, _, _ in seqs], device=device).view(-1, 1, 1)
    ctx = torch.tensor([c for _, c, _ in seqs], device=device).view(-1, 1, 1)
    i = torch.arange(q_max, device=device).view(1, -1, 1)
    j = torch.arange(width * block_size, device=device).view(1, 1, -1)
    # Query i sits at position ctx - q_len + i; rest key j at shared * block_size + j.
    visible = (j + shared * block_size <= ctx - q_len + i) | ((i >= q_len) & (j == 0))
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    first_blocks = torch.tensor(first[:shared], dtype=torch.long, device=device)
    return SharedPrefix(blocks=first_blocks, rest_tables=tables, mask=mask.unsqueeze(1))


@dataclass(slots=True)
class PaddedGroup:
    """Sequences attended in one call. Query row i of sequence b sits at padded position
    b * q_max + i; `padded_index[k]` is where flat-batch row `token_rows[k]` goes."""

    token_rows: torch.Tensor  # [N] int64 rows of the flat batch
    padded_index: torch.Tensor  # [N] int64 positions in the [B * q_max] padded layout
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding points at block 0, masked)
    mask: torch.Tensor | None  # [B, 1, q_max, max_blocks * block_size] bool (None: kernel group)
    q_max: int
    is_whole_batch: bool  # rows are exactly 0..T-1 in padded order (pure decode): no scatter
    # The kernel group's only: the extension holding the backend's short-query kernel
    # (`AttentionBackend.kernel`; its `decode_layers` may run a kernel-group-only step whole),
    # and what that kernel reads besides the block tables.
    kernel: ModuleType | None = None
    row_start: torch.Tensor | None = None  # [B] first flat row of each sequence
    q_lens: torch.Tensor | None = None  # [B]
    ctx_lens: torch.Tensor | None = None  # [B] tokens in the cache after this step
    shared: SharedPrefix | None = None  # cascade attention plan (padded group only)
    # `mask` narrowed to each window the step's layers have, made on first use (padded group).
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` where query i of sequence b (at position ctx - q_len + i) sees keys
        (pos - window, pos] only; padded rows still see key 0 (never an all-masked row)."""
        m = self._window_masks.get(window)
        if m is None:
            q_max, keys = self.mask.shape[-2], self.mask.shape[-1]
            q_len, ctx = self.q_lens.view(-1, 1, 1), self.ctx_lens.view(-1, 1, 1)
            i = torch.arange(q_max, device=q_len.device).view(1, -1, 1)
            j = torch.arange(keys, device=q_len.device).view(1, 1, -1)
            pos = ctx - q_len + i
            m = ((j <= pos) & (j > pos - window)) | ((i >= q_len) & (j == 0))
            m = self._window_masks[window] = m.unsqueeze(1)
        return m


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention plan (module docstring): every layer reads the same one."""

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    block_size: int
    group: PaddedGroup | None  # the padded SDPA group (cascade attention when a prefix is shared)
    prefills: list[PrefillSlice]
    # Sequences whose queries the short-query kernel takes (decodes, 1 + k verification rows): by
    # each sequence's own query length, so its path never depends on the rest of the step.
    kernel_group: PaddedGroup | None = None
    # Rows whose K/V also go to a second slot: the keys a draft-tree leaf's scratch block repeats
    # (inferd/engine/model_runner.py). None when the step has no leaves.
    mirror_rows: torch.Tensor | None = None
    mirror_slots: torch.Tensor | None = None
    # KV cache groups (inferd/kv/kv_groups.py), when the model has more than one: each group's
    # plan (the same rows, its own slots and block tables) and the group of each layer. This
    # plan is group 0's. None: one group, every layer reads this plan.
    kv_groups: list[AttentionMetadata] | None = None
    layer_group: tuple[int, ...] | None = None

    def groups(self) -> list[AttentionMetadata]:
        """Every KV group's plan, in group order."""
        return self.kv_groups if self.kv_groups is not None else [self]

    def layer_groups(self, num_layers: int) -> list[int]:
        """The KV group of each of the model's `num_layers` layers."""
        return list(self.layer_group) if self.layer_group is not None else [0] * num_layers

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The plan layer `layer` attends with: its KV group's."""
        if self.kv_groups is None:
            return self
        return self.kv_groups[self.layer_group[layer]]
