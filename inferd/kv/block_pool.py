"""The global pool of fixed-size KV blocks: reference counts and a free list. Ids only, no tensors."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Freed blocks go to the front and are reused first; blocks never used wait at the back.
        # (Blocks the prefix cache holds are not on this list, so nothing reusable is lost.) On
        # the CPU the pool is a lazily zero-filled mapping: a block's first write page-faults
        # (in a VM, milliseconds per MB: a large share of a prefill), and its lines leave the
        # caches the longer it sits free. Reusing the warm blocks keeps a server's touched memory
        # at its peak use instead of walking through the whole pool once.
        self._free: deque[int] = deque(range(num_blocks))
        # Blocks [0, high_water) have been handed out at least once; fresh ones leave in id order,
        # so the next fresh block is high_water (inferd/kv/prefault.py faults its pages in ahead).
        self.high_water = 0
        # Blocks the prefix cache owns, and how many of them nobody else holds (ref count 1):
        # those are reclaimable by eviction, so they count as available, not as used.
        self._cached: set[int] = set()
        self.num_cached_only = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks plus blocks only the prefix cache holds (evictable on demand)."""
        return len(self._free) + self.num_cached_only

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cache-only blocks count as available)."""
        return 1.0 - self.num_available / self.num_blocks

    def mark_cached(self, block: int) -> None:
        """The prefix cache took a reference on `block` (already counted in its ref count)."""
        self._cached.add(block)
        if self.ref_counts[block] == 1:
            self.num_cached_only += 1

    def unmark_cached(self, block: int) -> None:
        """The prefix cache is about to drop its reference on `block`."""
        self._cached.discard(block)
        if self.ref_counts[block] == 1:
            self.num_cached_only -= 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
            if b >= self.high_water:
                self.high_water = b + 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            if self.ref_counts[b] == 1 and b in self._cached:
                self.num_cached_only -= 1
            self.ref_counts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        freed = []
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
            elif self.ref_counts[b] == 1 and b in self._cached:
                self.num_cached_only += 1
        self._free.extendleft(reversed(freed))  # in their order, ahead of the rest

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + in-use = total, no block both free and referenced, refs match the owners'."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has negative ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, on free list {b in free}"
        cached_only = sum(1 for b in self._cached if self.ref_counts[b] == 1)
        assert cached_only == self.num_cached_only, f"{self.num_cached_only=} but {cached_only} counted"
        if expected_refs is not None:
            actual = {b: rc for b, rc in enumerate(self.ref_counts) if rc}
            assert actual == expected_refs, f"ref counts {actual} != owners' {expected_refs}"
