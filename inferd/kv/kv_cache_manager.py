"""Per-sequence block tables over the global `BlockPool`: allocation, sharing (fork), copy-on-write.

A sequence's block table covers token positions [0, len(table) * block_size). Blocks may be shared
by several sequences (n > 1 samples of one prompt); a write into a shared block first copies it to a
fresh block (copy-on-write), recorded in `pending_copies` for the model runner to apply before the
step's forward pass.
"""

from __future__ import annotations

from collections import Counter

from inferd.kv.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.block_tables: dict[int, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        """Make room to write positions [num_computed, num_computed + num_new). False: no room
        (and nothing changed); the scheduler then preempts someone and tries again."""
        table = self.block_tables.setdefault(seq_id, [])
        first = num_computed // self.block_size
        last = (num_computed + num_new - 1) // self.block_size
        shared = [i for i in range(first, min(last + 1, len(table))) if self.pool.ref_counts[table[i]] > 1]
        new = max(0, last + 1 - len(table))
        if new + len(shared) > self.pool.num_free:
            return False
        for i in shared:
            (dst,) = self.pool.allocate(1)
            self.pending_copies.append((table[i], dst))
            self.pool.decref([table[i]])
            table[i] = dst
        table.extend(self.pool.allocate(new))
        return True

    def slot(self, seq_id: int, position: int) -> int:
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counted)."""
        table = self.block_tables[parent_id]
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id, None)
        if table:
            # Free tail-first so a later prefix cache can keep the head longest.
            self.pool.decref(reversed(table))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        owners = Counter(b for table in self.block_tables.values() for b in table)
        self.pool.check_integrity(dict(owners))
