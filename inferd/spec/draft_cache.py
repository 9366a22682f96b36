"""One sequence's keys and values for the learned draft head's attention (inferd.spec.eagle_head).

The engine's proposer keeps one `DraftCache` per sequence, fed from the target's hidden states
after each step; a draft chain appends its own keys after the true ones, where the next write
overwrites them.
"""

from __future__ import annotations

import torch


class DraftCache:
    """The keys and values of one sequence's true positions [lo, end) (from the target's hidden
    states), in buffers that grow by doubling; `x_last` is the head's input at end - 1, where
    the next chain of drafts starts."""

    __slots__ = ("end", "k", "lo", "v", "x_last")

    def __init__(self, like: torch.Tensor, kv_heads: int, head_dim: int) -> None:
        self.k = like.new_empty((16, kv_heads, head_dim))
        self.v = like.new_empty((16, kv_heads, head_dim))
        self.lo = self.end = 0
        self.x_last: torch.Tensor | None = None

    def write(self, start: int, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries for positions [start, start + len(k)). Writing at or before `end` overwrites
        from there (a recomputation after preemption); a gap starts the cache afresh at `start`
        (positions the target did not compute, e.g. a prefix served from its cache)."""
        if start > self.end or start < self.lo:
            self.lo = self.end = start
        n = len(k)
        need = start + n - self.lo
        self.end = min(self.end, start)  # rows from `start` on are replaced
        self.reserve(need - (self.end - self.lo))
        self.k[start - self.lo : need] = k
        self.v[start - self.lo : need] = v
        self.end = start + n
        self.x_last = x[-1]

    def reserve(self, extra: int) -> None:
        """Room for `extra` rows after `end` (a draft chain writes its own keys there)."""
        need = self.end - self.lo + extra
        if need > len(self.k):
            cap = max(need, 2 * len(self.k))
            grown_k, grown_v = (
                self.k.new_empty((cap, *self.k.shape[1:])),
                self.v.new_empty((cap, *self.v.shape[1:])),
            )
            used = self.end - self.lo
            grown_k[:used], grown_v[:used] = self.k[:used], self.v[:used]
            self.k, self.v = grown_k, grown_v

    def copy(self) -> DraftCache:
        other = DraftCache.__new__(DraftCache)
        other.k, other.v = self.k.clone(), self.v.clone()
        other.lo, other.end, other.x_last = self.lo, self.end, self.x_last
        return other

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.end - self.lo
        return self.k[:n], self.v[:n]
