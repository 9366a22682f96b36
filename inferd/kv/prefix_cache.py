"""RadixAttention-style prefix cache at block granularity.

A tree over token ids in which every edge is one full block of `block_size` tokens and every node
owns the KV block that holds those tokens (given the path above it). The tree holds one reference
on each of its blocks; a running sequence that reuses a block holds another. So:

- a node whose block has ref count 1 is held by the tree alone: evictable once it is a leaf;
- a block in use by a running sequence (ref > 1) is never evicted;
- eviction takes unreferenced leaves, least recently used first, and frees their blocks.

Only full blocks are cached: a sequence never writes into a cached block (it writes at positions
>= its computed length, past every full block it matched), so sharing needs no copy-on-write.
`NullPrefixCache` is the same interface doing nothing, for `--no-enable-prefix-caching`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from inferd.kv.block_pool import BlockPool


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_access")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


class PrefixCache:
    enabled = True

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = _Node((), -1, None)
        self.num_nodes = 0
        self._clock = itertools.count(1)
        # Bumped whenever a node is added or removed: a lookup's answer stays valid while the
        # version does (touching nodes for LRU changes no answer), so callers may memoise it.
        self.version = 0

    def _chunks(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None):
        # A salt (a tenant's, privacy.py) leads the first block's key: salted sequences match only
        # blocks cached under the same salt, and their whole subtree hangs off that first key.
        bs = self.block_size
        for i in range(num_blocks):
            key = tuple(token_ids[i * bs : (i + 1) * bs])
            yield (salt, *key) if i == 0 and salt is not None else key

    def match(
        self, token_ids: Sequence[int], max_tokens: int, touch: bool = True, salt: str | None = None
    ) -> list[int]:
        """Blocks of the longest cached prefix of `token_ids`, at most `max_tokens` tokens long,
        among those cached under `salt`. Touches the matched nodes (LRU) unless `touch` is False
        (a scheduler's peek) and takes no reference: the caller increfs what it keeps."""
        node, blocks = self.root, []
        now = next(self._clock)
        for key in self._chunks(token_ids, max_tokens // self.block_size, salt):
            child = node.children.get(key)
            if child is None:
                break
            if touch:
                child.last_access = now
            blocks.append(child.block)
            node = child
        return blocks

    def insert(
        self,
        token_ids: Sequence[int],
        table: list[int],
        start_block: int,
        end_block: int,
        salt: str | None = None,
    ) -> None:
        """Cache full blocks [start_block, end_block) of a sequence whose blocks [0, start_block)
        are already in the tree. Where the tree already holds a block for the same tokens (two
        requests computed the same prefix at once), the sequence switches to the tree's block and
        drops its own copy, so each prefix is stored once."""
        node = self.root
        now = next(self._clock)
        for i, key in enumerate(self._chunks(token_ids, end_block, salt)):
            child = node.children.get(key)
            if i >= start_block:
                if child is None:
                    child = _Node(key, table[i], node)
                    node.children[key] = child
                    self.pool.incref([table[i]])
                    self.pool.mark_cached(table[i])
                    self.num_nodes += 1
                    self.version += 1
                elif child.block != table[i]:
                    self.pool.incref([child.block])
                    self.pool.decref([table[i]])
                    table[i] = child.block
            assert child is not None and child.block == table[i], "sequence diverged from the tree"
            child.last_access = now
            node = child

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks held only by the tree, LRU leaves first; returns count."""
        if num_blocks <= 0 or not self.num_nodes:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if self.pool.ref_counts[n.block] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.pool.unmark_cached(node.block)
            self.pool.decref([node.block])
            self.num_nodes -= 1
            self.version += 1
            freed += 1
            if parent is not self.root and not parent.children and self.pool.ref_counts[parent.block] == 1:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> bool:
        """Drop every cached block no running sequence uses; True if the tree is now empty."""
        self.evict(self.num_nodes)
        return self.num_nodes == 0

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def blocks(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.block)
            stack.extend(node.children.values())
        return out


class NullPrefixCache:
    """Prefix caching off: nothing matches, nothing is kept."""

    enabled = False
    num_nodes = 0
    version = 0

    def match(self, token_ids: Sequence[int], max_tokens: int, touch: bool = True, salt=None) -> list[int]:
        return []

    def insert(self, token_ids, table, start_block, end_block, salt=None) -> None:
        return None

    def evict(self, num_blocks: int) -> int:
        return 0

    def reset(self) -> bool:
        return True

    def blocks(self) -> list[int]:
        return []
