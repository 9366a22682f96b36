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

KV cache groups (inferd/kv/kv_groups.py): a node holds one block per group, the same tokens'
K/V in that group's layers. A sliding-window group's block may be missing (its sequence gave it
back before offering it, or eviction took it): a hit of k blocks needs, in each full-attention
group, every block of the path, and in a windowed group only those its first computed query reads
(the window before position k * block_size), as vLLM's hybrid prefix caching does. Eviction takes
least recently used units: a windowed group's unreferenced block from any node (a hit point
further on needs it no more than the hit points it serves), or a whole leaf none of whose blocks
is in use.

KV events (kv_events.py): with a publisher attached, every node added is published as stored and
every node removed as removed, under its chained block hash (block_hash.py); a node is one block
position whatever its groups hold. A KV connector that wants evicted blocks (a KV tier,
inferd/kv/connectors) hears of every leaf evicted whole with a block in every group: its hash and
its blocks, whose contents stay in the pool until the next step runs. Without either, no hash is
computed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from inferd.kv.block_hash import ROOT_HASH, block_hash
from inferd.kv.block_pool import BlockPool
from inferd.kv.kv_events import NullKVEvents
from inferd.kv.kv_groups import NULL_BLOCK

# A node's block of a group it does not hold.
_MISSING = -1


class _Node:
    __slots__ = ("key", "blocks", "parent", "children", "last_access", "hash")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: _Node | None) -> None:
        self.key = key
        self.hash = ROOT_HASH  # set when KV events are on
        self.blocks = blocks  # per group: its block, or _MISSING
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


class PrefixCache:
    enabled = True

    def __init__(self, pool: BlockPool, block_size: int, windows: Sequence[int | None] = (None,),
                 events=None, connector=None) -> None:  # fmt: skip
        self.pool = pool
        self.events = events or NullKVEvents()  # a kv_events publisher
        # A KV connector told of evicted blocks (inferd/kv/connectors/base.py), or None.
        self.connector = connector if connector is not None and connector.wants_evicted_blocks else None
        self._hashing = self.events.enabled or self.connector is not None
        self.block_size = block_size
        self.windows = tuple(windows)  # per KV group: its sliding window, None for full attention
        self.root = _Node((), [_MISSING] * len(self.windows), None)
        self.num_nodes = 0
        self._clock = itertools.count(1)
        # Bumped whenever a node or block is added or removed: a lookup's answer stays valid while
        # the version does (touching nodes for LRU changes no answer), so callers may memoise it.
        self.version = 0

    def _chunks(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None):
        # A salt (a tenant's, privacy.py) leads the first block's key: salted sequences match only
        # blocks cached under the same salt, and their whole subtree hangs off that first key.
        bs = self.block_size
        for i in range(num_blocks):
            key = tuple(token_ids[i * bs : (i + 1) * bs])
            yield (salt, *key) if i == 0 and salt is not None else key

    def first_needed(self, window: int | None, num_blocks: int) -> int:
        """The first block a group needs for a hit of `num_blocks` blocks: its first computed
        query, at position num_blocks * block_size, reads keys from there - window + 1 on."""
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def match_groups(self, token_ids: Sequence[int], max_tokens: int, touch: bool = True,
                     salt: str | None = None) -> tuple[int, list[list[int]]]:  # fmt: skip
        """The longest cached prefix of `token_ids` (at most `max_tokens` tokens) every group can
        serve, among blocks cached under `salt`: (its blocks k, per group a table of k entries,
        NULL_BLOCK where the group needs none). Touches the nodes used (LRU) unless `touch` is
        False (a scheduler's peek) and takes no reference: the caller increfs what it keeps."""
        path: list[_Node] = []
        node = self.root
        for key in self._chunks(token_ids, max_tokens // self.block_size, salt):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        k = len(path)
        windowed: list[tuple[int, list[int]]] = []  # (window, blocks missing in path[:i] per i)
        for g, window in enumerate(self.windows):
            if window is None:  # every block of the path up to the first it lacks
                k = next((i for i, n in enumerate(path[:k]) if n.blocks[g] == _MISSING), k)
            else:
                missing = [0]
                for n in path:
                    missing.append(missing[-1] + (n.blocks[g] == _MISSING))
                windowed.append((window, missing))
        # The longest hit whose windowed groups hold every block their window needs.
        while k > 0 and any(miss[k] > miss[self.first_needed(w, k)] for w, miss in windowed):
            k -= 1
        tables = []
        for g, window in enumerate(self.windows):
            first = self.first_needed(window, k)
            tables.append([NULL_BLOCK] * first + [path[i].blocks[g] for i in range(first, k)])
        if touch and k:
            now = next(self._clock)
            for n in path[:k]:
                n.last_access = now
        return k, tables

    def match(self, token_ids: Sequence[int], max_tokens: int, touch: bool = True,
              salt: str | None = None) -> list[int]:  # fmt: skip
        """One group of full attention: the blocks of the longest cached prefix."""
        return self.match_groups(token_ids, max_tokens, touch, salt)[1][0]

    def insert(self, token_ids: Sequence[int], tables: list[list[int]], released: Sequence[int],
               end_block: int, salt: str | None = None) -> None:  # fmt: skip
        """Cache the full blocks [0, end_block) of a sequence, per group `tables[g]` of which
        entries [0, released[g]) were given back (NULL_BLOCK). Where the tree already holds a
        group's block for the same tokens (two requests computed the same prefix at once), the
        sequence switches to the tree's block and drops its own copy, so each prefix is stored
        once; where the tree lacks one the sequence holds, it takes the sequence's."""
        node = self.root
        now = next(self._clock)
        stored: list[int] = []
        for i, key in enumerate(self._chunks(token_ids, end_block, salt)):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, [_MISSING] * len(self.windows), node)
                node.children[key] = child
                self.num_nodes += 1
                self.version += 1
                if self._hashing:
                    child.hash = block_hash(node.hash, key)
                    stored.append(child.hash)
            for g, table in enumerate(tables):
                if i < released[g]:
                    continue  # the sequence holds no block there
                mine, cached = table[i], child.blocks[g]
                if cached == _MISSING:
                    child.blocks[g] = mine
                    self.pool.incref([mine])
                    self.pool.mark_cached(mine)
                    self.version += 1
                elif cached != mine:
                    self.pool.incref([cached])
                    self.pool.decref([mine])
                    table[i] = cached
            child.last_access = now
            node = child
        if self.events.enabled:
            self.events.stored(stored)

    def _drop(self, node: _Node, g: int) -> int:
        block = node.blocks[g]
        if block == _MISSING:
            return 0
        node.blocks[g] = _MISSING
        self.pool.unmark_cached(block)
        self.pool.decref([block])
        self.version += 1
        return 1

    def _leaf_evictable(self, node: _Node) -> bool:
        return not node.children and all(b == _MISSING or self.pool.ref_counts[b] == 1 for b in node.blocks)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks held only by the tree, least recently used first: whole
        leaves, and windowed groups' blocks of any node; returns the count freed."""
        if num_blocks <= 0 or not self.num_nodes:
            return 0
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        # Entries (last access, tie-break, node, group): group -1 removes the whole leaf.
        heap = []
        for n in self._nodes():
            if self._leaf_evictable(n):
                heap.append((n.last_access, id(n), n, -1))
            else:
                heap.extend((n.last_access, id(n), n, g) for g in windowed
                            if n.blocks[g] != _MISSING and self.pool.ref_counts[n.blocks[g]] == 1)  # fmt: skip
        heapq.heapify(heap)
        freed = 0
        removed: list[int] = []
        evicted: list[tuple[int, list[int]]] = []  # (hash, block per group) for the connector
        while heap and freed < num_blocks:
            _, _, node, g = heapq.heappop(heap)
            if g >= 0:
                block = node.blocks[g]
                in_tree = node.parent is not None and node.key in node.parent.children
                if in_tree and block != _MISSING and self.pool.ref_counts[block] == 1:
                    freed += self._drop(node, g)
                continue
            parent = node.parent
            del parent.children[node.key]
            if self.connector is not None and _MISSING not in node.blocks:
                evicted.append((node.hash, list(node.blocks)))
            for gi in range(len(node.blocks)):
                freed += self._drop(node, gi)
            self.num_nodes -= 1
            self.version += 1
            removed.append(node.hash)
            if parent is not self.root and self._leaf_evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent, -1))
        if self.events.enabled:
            self.events.removed(removed)
        if evicted:
            self.connector.blocks_evicted(evicted)
        return freed

    def reset(self) -> bool:
        """Drop every cached block no running sequence uses; True if the tree is now empty."""
        self.evict(self.pool.num_blocks + self.num_nodes + 1)  # more than it could free
        return self.num_nodes == 0

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def blocks(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks if b != _MISSING]


class NullPrefixCache:
    """Prefix caching off: nothing matches, nothing is kept."""

    enabled = False
    num_nodes = 0
    version = 0

    def match_groups(self, token_ids: Sequence[int], max_tokens: int, touch: bool = True,
                     salt: str | None = None) -> tuple[int, list[list[int]]]:  # fmt: skip
        return 0, []

    def match(self, token_ids: Sequence[int], max_tokens: int, touch: bool = True, salt=None) -> list[int]:
        return []

    def insert(self, token_ids, tables, released, end_block, salt=None) -> None:
        return None

    def evict(self, num_blocks: int) -> int:
        return 0

    def reset(self) -> bool:
        return True

    def blocks(self) -> list[int]:
        return []
