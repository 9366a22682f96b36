"""An approximate radix tree of what the router has sent to one worker, pruned LRU to a size.

The router never sees a worker's real prefix cache (unless KV events are on: kv_index.py); it
remembers the prompts it routed there instead and assumes the worker still caches them. Keys are
token ids (a tuple) or text (a str): one tree holds one kind. Edges are compressed runs; a node's
children are keyed by their edge's first element. `size` counts the elements on all edges; past
`max_size` the least recently used leaves go first (a worker's own LRU evicts in that order too).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

Key = tuple[int, ...] | str


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case on a hit: one comparison in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slices, compared in C
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "edge", "last_access", "parent")

    def __init__(self, edge: Key, parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[object, _Node] = {}
        self.last_access = 0


class RadixTree:
    """Prefixes sent to one worker. Not thread-safe: the router's event loop owns it."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.root = _Node((), None)
        self.size = 0  # elements on every edge
        self._clock = itertools.count(1)

    def match_len(self, key: Key, touch: bool = True) -> int:
        """Length of the longest prefix of `key` in the tree; touches its nodes (LRU) if `touch`."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.edge, key[pos : pos + len(child.edge)])
            if touch:
                child.last_access = now
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos

    def insert(self, key: Key) -> None:
        """Add `key` (its new suffix; shared prefixes are stored once), then prune to max_size."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node)
                leaf.last_access = now
                node.children[key[pos]] = leaf
                self.size += len(leaf.edge)
                break
            n = common_prefix_len(child.edge, key[pos : pos + len(child.edge)])
            if n < len(child.edge):  # split: child's edge becomes edge[:n] -> edge[n:]
                mid = _Node(child.edge[:n], node)
                node.children[key[pos]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_access = now
            pos += n
            node = child
        if self.size > self.max_size:
            self.prune(self.max_size)

    def prune(self, max_size: int) -> None:
        """Drop least recently used leaves until at most `max_size` elements remain."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while heap and self.size > max_size:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def check_integrity(self) -> None:
        """Sizes add up, children are keyed by their edge's first element, parents link back."""
        total = 0
        for node in self._nodes():
            assert node.edge, "an empty edge below the root"
            assert node.parent is not None and node.parent.children[node.edge[0]] is node
            total += len(node.edge)
        assert total == self.size, (total, self.size)
