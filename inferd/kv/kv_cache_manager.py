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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from inferd.kv.block_pool import BlockPool
from inferd.kv.prefix_cache import NullPrefixCache, PrefixCache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_cache: PrefixCache | NullPrefixCache = (
            PrefixCache(self.pool, block_size) if enable_prefix_caching else NullPrefixCache()
        )
        self.block_tables: dict[int, list[int]] = {}
        self._num_cached_blocks: dict[int, int] = {}  # blocks [0, n) of a table are in the tree
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)
        self.pending_slot_copies: list[tuple[int, int]] = []  # (src slot, dst slot)
        self.scratch: dict[int, list[int]] = {}  # seq_id -> this step's draft-tree leaf blocks

    def cached_prefix_len(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Tokens of `token_ids` the prefix cache could serve now (a peek: nothing changes).
        `salt`: the sequence's cache salt (only blocks cached under it match)."""
        blocks = self.prefix_cache.match(token_ids, len(token_ids) - 1, touch=False, salt=salt)
        return len(blocks) * self.block_size

    def attach_cached_prefix(self, seq_id: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Start a sequence's table with the longest cached prefix; returns the tokens reused.
        At least one token is left to compute: the step needs its logits."""
        blocks = self.prefix_cache.match(token_ids, len(token_ids) - 1, salt=salt)
        self.pool.incref(blocks)
        self.block_tables[seq_id] = list(blocks)
        self._num_cached_blocks[seq_id] = len(blocks)
        return len(blocks) * self.block_size

    def _ensure_free(self, n: int) -> bool:
        if n > self.pool.num_available:
            return False  # even evicting the whole cache would not make room
        if n > self.pool.num_free:
            self.prefix_cache.evict(n - self.pool.num_free)
        return n <= self.pool.num_free

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        """Make room to write positions [num_computed, num_computed + num_new). False: no room
        (and nothing changed but evictions); the scheduler then preempts someone and retries."""
        table = self.block_tables.setdefault(seq_id, [])
        first = num_computed // self.block_size
        last = (num_computed + num_new - 1) // self.block_size
        shared = [i for i in range(first, min(last + 1, len(table))) if self.pool.ref_counts[table[i]] > 1]
        new = max(0, last + 1 - len(table))
        if not self._ensure_free(new + len(shared)):
            return False
        for i in shared:
            (dst,) = self.pool.allocate(1)
            self.pending_copies.append((table[i], dst))
            self.pool.decref([table[i]])
            table[i] = dst
        table.extend(self.pool.allocate(new))
        return True

    def allocate_scratch(self, seq_id: int, n: int, keep: int = 0) -> bool:
        """n blocks the sequence uses for this step only (the leaves of a draft tree, each
        verified against a copy of the block it would sit in), outside its block table and never
        offered to the prefix cache; `free_scratch` (or `free`) returns them. False: no room, with
        `keep` blocks left over (what other sequences may still need this step)."""
        assert seq_id not in self.scratch, "scratch blocks still held from an earlier step"
        if n + keep > self.pool.num_available or not self._ensure_free(n):
            return False
        self.scratch[seq_id] = self.pool.allocate(n)
        return True

    def free_scratch(self, seq_id: int) -> None:
        blocks = self.scratch.pop(seq_id, None)
        if blocks:
            self.pool.decref(blocks)

    def cache_computed_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed: int, salt: str | None = None
    ) -> None:
        """Offer the sequence's newly completed full blocks to the prefix cache (under `salt`)."""
        full = num_computed // self.block_size
        start = self._num_cached_blocks.get(seq_id, 0)
        if full > start and self.prefix_cache.enabled:
            self.prefix_cache.insert(token_ids, self.block_tables[seq_id], start, full, salt)
            self._num_cached_blocks[seq_id] = full

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks covering positions [0, num_tokens): speculative KV written for
        rejected draft tokens past them goes back to the pool."""
        table = self.block_tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        self.pool.decref(reversed(table[keep:]))
        del table[keep:]
        if self._num_cached_blocks.get(seq_id, 0) > keep:
            self._num_cached_blocks[seq_id] = keep

    def slot(self, seq_id: int, position: int) -> int:
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counted)."""
        table = self.block_tables[parent_id]
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)
        self._num_cached_blocks[child_id] = self._num_cached_blocks.get(parent_id, 0)

    def free(self, seq_id: int) -> None:
        self.free_scratch(seq_id)
        self._num_cached_blocks.pop(seq_id, None)
        table = self.block_tables.pop(seq_id, None)
        if table:
            # Tail first: the free list then hands out the tail blocks before the prefix ones.
            self.pool.decref(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Flush every cached block no running sequence uses; True if the cache is now empty."""
        return self.prefix_cache.reset()

    def move_slot(self, seq_id: int, src_block: int, position: int) -> None:
        """Queue a copy of position `position`'s K/V from `src_block` (a scratch block of this
        step) into the sequence's own block for that position."""
        bs = self.block_size
        self.pending_slot_copies.append((src_block * bs + position % bs, self.slot(seq_id, position)))

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(block copies, slot copies) queued since the last call, for the next forward pass."""
        blocks, self.pending_copies = self.pending_copies, []
        slots, self.pending_slot_copies = self.pending_slot_copies, []
        return blocks, slots

    def check_integrity(self) -> None:
        owners = Counter(b for table in self.block_tables.values() for b in table)
        owners.update(b for blocks in self.scratch.values() for b in blocks)
        owners.update(self.prefix_cache.blocks())
        self.pool.check_integrity(dict(owners))
