"""Which nodes a greedy verification spends its rows on (EAGLE-2's dynamic draft tree, inside the
chain's own budget).

A chain of k drafts verifies k rows, but its last drafts are worth little when the head was
unsure early on: the draft at depth j is accepted only if every draft above it was. The head's
runner-up (or third likeliest token) at a shallow depth, accepted when the chain's draft there is
wrong and it is the target's token, is often worth more. Each candidate node is valued by the
head's own probability that the path to it is the target's:

    chain draft at depth j:       p1(1) · ... · p1(j)
    alternative a at depth j:     p1(1) · ... · p1(j - 1) · pa(j)   (a = 2: runner-up, 3: third)

(p1, pa: the head's softmax probability of its drafted token and of its a-th likeliest at that
depth, given the chain above), and the `budget` nodes of largest value are verified (how many:
the policy's `verified_rows`). A node's value never exceeds its parent's, nor an alternative's its
depth's draft's (pa <= p1), so the chosen set is a chain from the root with leaves at some of its
depths: what the engine verifies (each leaf a row of its own, see inferd/engine/model_runner.py).

Spending rows this way instead of on the chain alone makes the same number of verified rows emit
more tokens on average: a likely runner-up near the root is worth more than a deep draft the
head was unsure of.
"""

from __future__ import annotations

import torch

Node = tuple[float, int, int]  # (value, 0 for the chain's draft or which alternative 1.., depth)


def ranked_nodes(probs: list[tuple[float, ...]]) -> list[Node]:
    """Every node of a chain with alternatives, likeliest first: probs[j] = (p1, p2, ...) at depth
    j + 1, the drafted token's and each alternative's (runner-up, third...). Ties go to the chain's
    draft, then to the likelier alternative, then to the shallower node. Any prefix of the order
    is a chain from the root with leaves at some of its depths: an alternative's value is at most
    its depth's draft's (p2 <= p1), which wins ties, so a leaf is never deeper than the chain."""
    nodes: list[Node] = []
    path = 1.0
    for depth, (p1, *alts) in enumerate(probs, start=1):
        nodes.extend((path * p, which, depth) for which, p in enumerate(alts, start=1))
        path *= p1
        nodes.append((path, 0, depth))
    nodes.sort(key=lambda n: (-n[0], n[1], n[2]))
    return nodes


def chosen_nodes(nodes: list[Node], budget: int) -> tuple[int, list[tuple[int, int]]]:
    """The first `budget` of ranked nodes as (how many of the chain's drafts to verify, the
    leaves: (depth (1-based), which alternative (0: the runner-up)), by depth then rank)."""
    chosen = nodes[: max(0, budget)]
    chain = sum(1 for _, which, _ in chosen if which == 0)
    return chain, sorted((d, which - 1) for _, which, d in chosen if which)


def rank_nodes(probs: list[tuple[float, ...]], budget: int) -> tuple[int, list[tuple[int, int]]]:
    """The `budget` likeliest nodes of a chain with alternatives (`ranked_nodes`,
    `chosen_nodes`)."""
    return chosen_nodes(ranked_nodes(probs), budget)


class SettledChains:
    """Drafting's early stop: after `depth` steps a chain can gain no deeper node in its `budget`
    likeliest once its chain nodes and its alternatives worth more than its deepest draft c_depth
    are `budget` or more (a deeper node is worth at most c_depth, and loses ties to the chain's
    shallower nodes): the chain's last drafts would be verified in no row. `step(probs)` takes
    each chain's (p1, p2, ...) of the next depth [B, 1 + A] and says whether every chain has
    settled.
    csrc/eagle_draft.h `chains_settled` is the same, in the same double arithmetic."""

    def __init__(self, num_chains: int, budget: int) -> None:
        self.budget = budget
        self.depth = 0
        self.path = [1.0] * num_chains
        self.leaves: list[list[float]] = [[] for _ in range(num_chains)]

    def step(self, probs: torch.Tensor) -> bool:
        self.depth += 1
        settled = True
        for i, (p1, *alts) in enumerate(probs.tolist()):
            self.leaves[i].extend(self.path[i] * p for p in alts)
            self.path[i] *= p1
            count = self.depth + sum(v > self.path[i] for v in self.leaves[i])
            settled = settled and count >= self.budget
        return settled
