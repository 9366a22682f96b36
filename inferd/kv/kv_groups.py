"""KV cache groups: a model's layers grouped by attention type, so that a sliding-window layer's
K/V is given back to the pool once every query still to come has left it behind (vLLM v1's
hybrid KV cache manager).

A group is a set of layers with one attention type: full attention, or a sliding window of W
keys. Every group has the same number of layers (`group_size`, the greatest common divisor of the
types' layer counts: Gemma 3's 15 local and 3 global layers make 5 local groups and 1 global group
of 3 layers; Gemma 2's alternating layers one of each; Mistral's one windowed group of all
layers). The pool is one tensor [group_size, 2, num_blocks, block_size, kv_heads, head_dim]: a
block id is one page of `group_size` layers, whichever group holds it, so every group draws on one
block budget. Layer l reads slot `layer_slot[l]` of the tensor through the block table its group
`layer_group[l]` keeps for each sequence.

A windowed group's table keeps its positions: blocks that slid out of the window are given back
and their entries left pointing at a placeholder block (`NULL_BLOCK`), which attention never reads
(a query at position p reads keys (p - W, p] only, and the paged kernels start at the first of
them). With one group of full attention (every model without windows, or `--disable-hybrid-kv-
cache-manager`) the layout is the plain [layers, 2, num_blocks, ...] pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferd.models.spec import ModelSpec

# What a released entry of a windowed group's block table holds. Block 0 is a real block (its
# contents are finite K/V or zeros); a query never reads the positions a released entry covers.
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class KVGroup:
    layers: tuple[int, ...]  # ascending model layer indices; layers[j] lives in pool slot j
    window: int | None  # the layers' sliding window; None: full attention


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_layers: int

    def __post_init__(self) -> None:
        sizes = {len(g.layers) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV groups must have equal layer counts, got {sorted(sizes)}")
        layers = sorted(l for g in self.groups for l in g.layers)
        if layers != list(range(self.num_layers)):
            raise ValueError("KV groups must cover every layer exactly once")

    @staticmethod
    def single(num_layers: int, window: int | None = None) -> KVLayout:
        """One group of every layer: the plain pool."""
        return KVLayout((KVGroup(tuple(range(num_layers)), window),), num_layers)

    @staticmethod
    def of(spec: ModelSpec, hybrid: bool = True) -> KVLayout:
        """The groups of a model of `spec`; `hybrid=False` (or a model without windows): one group
        that keeps every token of every layer."""
        n = len(spec.layers)
        windows = [layer.sliding_window for layer in spec.layers]
        if not hybrid or all(w is None for w in windows):
            return KVLayout.single(n)
        by_window: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)
        size = math.gcd(*(len(ls) for ls in by_window.values()))
        groups = [KVGroup(tuple(ls[j : j + size]), w)
                  for w, ls in by_window.items() for j in range(0, len(ls), size)]  # fmt: skip
        groups.sort(key=lambda g: g.layers[0])
        return KVLayout(tuple(groups), n)

    @property
    def group_size(self) -> int:
        """Layers per group: the pool tensor's first dimension."""
        return len(self.groups[0].layers)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Some group gives blocks back as they leave its window."""
        return any(g.window is not None for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for l in g.layers:
                out[l] = gi
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g in self.groups:
            for j, l in enumerate(g.layers):
                out[l] = j
        return tuple(out)

    def window_blocks(self, window: int, block_size: int, max_query: int) -> int:
        """Blocks a windowed group's table holds at most for one sequence: those a step's queries
        (at most `max_query` rows from a start position s) read, keys (s - window, s + max_query),
        each wherever it falls in its blocks."""
        return -(-(window - 1 + max_query) // block_size) + 1

    def blocks_for(self, num_tokens: int, block_size: int, max_query: int) -> int:
        """Pool blocks one sequence of `num_tokens` tokens holds at most (every group)."""
        full = -(-num_tokens // block_size)
        return sum(full if g.window is None else min(full, self.window_blocks(g.window, block_size, max_query))
                   for g in self.groups)  # fmt: skip

    def max_tokens(self, num_blocks: int, block_size: int, max_query: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) a pool of `num_blocks` blocks holds."""
        if self.blocks_for(limit, block_size, max_query) <= num_blocks:
            return limit
        lo, hi = 0, limit  # blocks_for grows with the length: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, max_query) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        """e.g. '6 KV groups of 3 layers: 5 window 512, 1 full'."""
        if self.num_groups == 1:
            w = self.groups[0].window
            return "1 KV group" + (
                "" if w is None else f" (window {w}: blocks freed as they leave it)"
            )
        kinds: dict[str, int] = {}
        for g in self.groups:
            key = "full" if g.window is None else f"window {g.window}"
            kinds[key] = kinds.get(key, 0) + 1
        parts = ", ".join(f"{c} {k}" for k, c in kinds.items())
        return f"{self.num_groups} KV groups of {self.group_size} layers: {parts}"


def kv_bytes_per_token_at(
    spec: ModelSpec, layer_token_bytes: int, context: int, hybrid: bool
) -> float:
    """Pool bytes per token of a `context`-token sequence: every layer keeps every token, or
    (`hybrid`) a windowed layer its last `window` tokens only. `layer_token_bytes`: one layer's
    K and V of one token."""
    n = len(spec.layers)
    if not hybrid:
        return n * layer_token_bytes
    held = sum(spec.kv_tokens_held(i, context) for i in range(n))
    return held * layer_token_bytes / context
