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
        # FIFO: a freed block goes to the back, so recently freed blocks are reused last.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + in-use = total, no block both free and referenced, refs match the owners'."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has negative ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, on free list {b in free}"
        if expected_refs is not None:
            actual = {b: rc for b, rc in enumerate(self.ref_counts) if rc}
            assert actual == expected_refs, f"ref counts {actual} != owners' {expected_refs}"
