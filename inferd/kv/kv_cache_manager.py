"""Per-sequence block tables over the global `BlockPool`: allocation, prefix reuse, sharing (fork),
copy-on-write.

A sequence's block table covers token positions [0, len(table) * block_size):
- [0, cached) blocks came from or went into the prefix cache (full blocks, never written again);
- the rest are its own, the last one possibly partial.
Blocks may also be shared by several sequences (n > 1 samples of one prompt); a write into a shared
block first copies it to a fresh block (copy-on-write), recorded in `pending_copies`; an accepted
draft-tree leaf's K/V moves from its scratch block into the sequence's own (`move_slot`). Both kinds
of copy travel to the model runner in the next `SchedulerOutput` (`take_pending_copies`) and run
before that step's forward pass, so they land before any write that could follow them. Scratch
blocks live for one step: the leaves of a speculative draft tree are verified in them
(inferd/engine/model_runner.py).

KV cache groups (inferd/kv/kv_groups.py): a model with sliding-window layers keeps one table per
group and sequence. `block_tables[seq_id]` is group 0's; `tables(seq_id)` lists every group's. A
windowed group gives its blocks back once the next query's window has left them: entries
[0, released) of its table are then `NULL_BLOCK` placeholders, never read and owned by nobody.
Every query a step computes lies at or after the sequence's computed length s, so it reads keys
(s - W, ...) only: a block wholly before s - W + 1 is never read again (a preempted sequence is
recomputed from scratch, a rejected draft rolls back no further than s).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from inferd.kv.block_pool import BlockPool
from inferd.kv.kv_groups import NULL_BLOCK, KVLayout
from inferd.kv.prefix_cache import NullPrefixCache, PrefixCache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: KVLayout | None = None, kv_events=None, connector=None) -> None:  # fmt: skip
        """`kv_events`: a kv_events publisher the prefix cache reports to (None: none);
        `connector`: a KV connector it reports evicted blocks to (inferd/kv/connectors)."""
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.layout = layout or KVLayout.single(1)
        self.windows = self.layout.windows  # per group: its window, None for full attention
        self.num_groups = len(self.windows)
        self.prefix_cache: PrefixCache | NullPrefixCache = (
            PrefixCache(self.pool, block_size, self.windows, kv_events, connector) if enable_prefix_caching else NullPrefixCache()
        )
        self.block_tables: dict[int, list[int]] = {}  # group 0's
        self._more_tables: dict[int, list[list[int]]] = {}  # groups 1.. (hybrid layouts)
        # Per sequence and group: entries [0, n) of the table were released (NULL_BLOCK).
        self._released: dict[int, list[int]] = {}
        self._num_cached_blocks: dict[int, int] = {}  # blocks [0, n) of a table are in the tree
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)
        self.pending_slot_copies: list[tuple[int, int]] = []  # (src slot, dst slot)
        # seq_id -> this step's draft-tree leaf blocks, one list per group
        self.scratch: dict[int, list[list[int]]] = {}

    def tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table of each group (group 0's is `block_tables[seq_id]`)."""
        return [self.block_tables[seq_id], *self._more_tables.get(seq_id, ())]

    def _new_tables(self, seq_id: int, first: list[int]) -> list[list[int]]:
        self.block_tables[seq_id] = first
        if self.num_groups > 1:
            self._more_tables[seq_id] = [[] for _ in range(self.num_groups - 1)]
        return self.tables(seq_id)

    def _owned(self, seq_id: int) -> list[list[int]]:
        """Per group, the blocks the sequence holds a reference on (released entries excluded)."""
        released = self._released.get(seq_id)
        tables = self.tables(seq_id)
        if released is None:
            return tables
        return [t[r:] for t, r in zip(tables, released)]

    def num_blocks_held(self, seq_id: int) -> int:
        """Pool blocks the sequence's tables reference (every group)."""
        return sum(len(t) for t in self._owned(seq_id)) if seq_id in self.block_tables else 0

    def cached_prefix_len(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Tokens of `token_ids` the prefix cache could serve now (a peek: nothing changes).
        `salt`: the sequence's cache salt (only blocks cached under it match)."""
        k = self.prefix_cache.match_groups(token_ids, len(token_ids) - 1, touch=False, salt=salt)[0]
        return k * self.block_size

    def attach_cached_prefix(self, seq_id: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Start a sequence's table with the longest cached prefix; returns the tokens reused.
        At least one token is left to compute: the step needs its logits."""
        k, tables = self.prefix_cache.match_groups(token_ids, len(token_ids) - 1, salt=salt)
        if not k:
            self._new_tables(seq_id, [])
            return 0
        # A windowed group's table starts with placeholders where it needs no block.
        released = [self.prefix_cache.first_needed(w, k) for w in self.windows]
        for table, r in zip(tables, released):
            self.pool.incref(table[r:])
        first, *more = tables
        self.block_tables[seq_id] = first
        if more:
            self._more_tables[seq_id] = more
        if any(released):
            self._released[seq_id] = released
        self._num_cached_blocks[seq_id] = k
        return k * self.block_size

    def _ensure_free(self, n: int) -> bool:
        if n > self.pool.num_available:
            return False  # even evicting the whole cache would not make room
        if n > self.pool.num_free:
            self.prefix_cache.evict(n - self.pool.num_free)
        return n <= self.pool.num_free

    def _release_out_of_window(self, seq_id: int, start: int) -> None:
        """Give back each windowed group's blocks that no query from position `start` on reads:
        those wholly before start - W + 1 (the first key that query sees)."""
        released = self._released.setdefault(seq_id, [0] * self.num_groups)
        for g, (table, window) in enumerate(zip(self.tables(seq_id), self.windows)):
            if window is None:
                continue
            end = min(len(table), max(0, start - window + 1) // self.block_size)
            if end > released[g]:
                self.pool.decref(table[released[g] : end])
                table[released[g] : end] = [NULL_BLOCK] * (end - released[g])
                released[g] = end

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        """Make room to write positions [num_computed, num_computed + num_new) in every group (and
        give back windowed groups' blocks that slid out of the window before num_computed).
        False: no room (and nothing changed but evictions and those releases); the scheduler then
        preempts someone and retries."""
        if seq_id not in self.block_tables:
            self._new_tables(seq_id, [])
        if self.layout.is_hybrid:
            self._release_out_of_window(seq_id, num_computed)
        tables = self.tables(seq_id)
        released = self._released.get(seq_id) or [0] * self.num_groups
        first = num_computed // self.block_size
        last = (num_computed + num_new - 1) // self.block_size
        assert all(first >= r for r in released), "writing into blocks given back to the pool"
        shared = [[i for i in range(first, min(last + 1, len(table))) if self.pool.ref_counts[table[i]] > 1]
                  for table in tables]  # fmt: skip
        new = [max(0, last + 1 - len(table)) for table in tables]
        if not self._ensure_free(sum(new) + sum(map(len, shared))):
            return False
        for table, cow, n in zip(tables, shared, new):
            for i in cow:
                (dst,) = self.pool.allocate(1)
                self.pending_copies.append((table[i], dst))
                self.pool.decref([table[i]])
                table[i] = dst
            table.extend(self.pool.allocate(n))
        return True

    def allocate_scratch(self, seq_id: int, n: int, keep: int = 0) -> bool:
        """n blocks per group the sequence uses for this step only (the leaves of a draft tree,
        each verified against a copy of the block it would sit in), outside its block tables and
        never offered to the prefix cache; `free_scratch` (or `free`) returns them. False: no
        room, with `keep` blocks left over (what other sequences may still need this step)."""
        assert seq_id not in self.scratch, "scratch blocks still held from an earlier step"
        total = n * self.num_groups
        if total + keep > self.pool.num_available or not self._ensure_free(total):
            return False
        self.scratch[seq_id] = [self.pool.allocate(n) for _ in range(self.num_groups)]
        return True

    def free_scratch(self, seq_id: int) -> None:
        for blocks in self.scratch.pop(seq_id, ()):
            self.pool.decref(blocks)

    def cache_computed_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed: int, salt: str | None = None
    ) -> None:
        """Offer the sequence's newly completed full blocks to the prefix cache (under `salt`)."""
        full = num_computed // self.block_size
        start = self._num_cached_blocks.get(seq_id, 0)
        if full > start and self.prefix_cache.enabled:
            released = self._released.get(seq_id) or [0] * self.num_groups
            self.prefix_cache.insert(token_ids, self.tables(seq_id), released, full, salt)
            self._num_cached_blocks[seq_id] = full

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks covering positions [0, num_tokens): speculative KV written for
        rejected draft tokens past them goes back to the pool."""
        if seq_id not in self.block_tables:
            return
        keep = -(-num_tokens // self.block_size)
        released = self._released.get(seq_id)
        for g, table in enumerate(self.tables(seq_id)):
            if len(table) <= keep:
                continue
            r = released[g] if released else 0
            self.pool.decref(reversed(table[max(keep, r) :]))
            del table[keep:]
            if released and r > keep:
                released[g] = keep
        if self._num_cached_blocks.get(seq_id, 0) > keep:
            self._num_cached_blocks[seq_id] = keep

    def slot(self, seq_id: int, position: int, group: int = 0) -> int:
        table = self.block_tables[seq_id] if group == 0 else self._more_tables[seq_id][group - 1]
        return table[position // self.block_size] * self.block_size + (position % self.block_size)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counted)."""
        for owned in self._owned(parent_id):
            self.pool.incref(owned)
        first, *more = self.tables(parent_id)
        self.block_tables[child_id] = list(first)
        if more:
            self._more_tables[child_id] = [list(t) for t in more]
        if parent_id in self._released:
            self._released[child_id] = list(self._released[parent_id])
        self._num_cached_blocks[child_id] = self._num_cached_blocks.get(parent_id, 0)

    def free(self, seq_id: int) -> None:
        self.free_scratch(seq_id)
        self._num_cached_blocks.pop(seq_id, None)
        if seq_id not in self.block_tables:
            return
        owned = self._owned(seq_id)
        self.block_tables.pop(seq_id)
        self._more_tables.pop(seq_id, None)
        self._released.pop(seq_id, None)
        for blocks in owned:
            # Tail first: the free list then hands out the tail blocks before the prefix ones.
            self.pool.decref(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Flush every cached block no running sequence uses; True if the cache is now empty."""
        return self.prefix_cache.reset()

    def move_slot(self, seq_id: int, leaf: int, position: int) -> None:
        """Queue a copy of position `position`'s K/V from the scratch block of draft-tree leaf
        `leaf` (this step's) into the sequence's own block for that position, in every group."""
        bs = self.block_size
        for g, blocks in enumerate(self.scratch[seq_id]):
            self.pending_slot_copies.append((blocks[leaf] * bs + position % bs, self.slot(seq_id, position, g)))

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(block copies, slot copies) queued since the last call, for the next forward pass."""
        blocks, self.pending_copies = self.pending_copies, []
        slots, self.pending_slot_copies = self.pending_slot_copies, []
        return blocks, slots

    def check_integrity(self) -> None:
        owners = Counter(b for seq_id in self.block_tables for t in self._owned(seq_id) for b in t)
        owners.update(b for groups in self.scratch.values() for blocks in groups for b in blocks)
        owners.update(self.prefix_cache.blocks())
        self.pool.check_integrity(dict(owners))
