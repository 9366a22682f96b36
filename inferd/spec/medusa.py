"""Medusa proposals: K heads on the target's final hidden state at the last computed position
guess the next K tokens at once (inferd.spec.medusa_head); head d's top choice is the draft at
depth d, its runner-ups are the tree's alternatives there.

Candidates form a tree of the verifier's shape (a chain from the root, leaves beside it; see
inferd.spec.draft_tree), verified in the step's one forward:
- greedy sequences, `dynamic_tree` (the default): the rows go to the likeliest nodes of the chain
  and each depth's runner-up and third, valued by the heads' own probabilities (a node at depth j
  by p1(1)·…·p1(j − 1)·pa(j)), as many as the depth policy's `rows` says;
- `draft_topk` t > 1: a static tree, the chain plus each head's next t − 1 tokens as leaves at its
  depth (the policy verifies them while their hit rate pays);
- sampled sequences: the chain (the heads' argmax, deterministic drafts), accepted by the
  sampler's lossless rule.

Per sequence only one row is kept: the target's hidden state at the position before the last
token (what the heads read), taken from `observe`. A sequence whose latest row is not there (its
last token came from outside a forward) does not draft this step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferd.scheduler.sequence import Sequence
from inferd.spec.draft_tree import chosen_nodes, ranked_nodes
from inferd.spec.proposer import Proposer, ProposerContext

# The alternatives each head ranks beyond its top token: the dynamic tree's runner-up and third.
_RANKED_ALTERNATIVES = 2


class MedusaProposer(Proposer):
    method = "medusa"
    needs_hidden = True

    def __init__(self, ctx: ProposerContext) -> None:
        from inferd.spec.medusa_head import MedusaHead

        spec = ctx.spec
        self.head = MedusaHead.load(spec.model, ctx.target, quantize=True)
        if spec.num_speculative_tokens > self.head.num_heads:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens {spec.num_speculative_tokens} "
                f"exceeds the {self.head.num_heads} heads of the Medusa head in {spec.model}"
            )
        self.dynamic_tree = spec.dynamic_tree and spec.draft_topk == 1
        self.ranks_drafts = self.dynamic_tree
        self.topk = spec.draft_topk
        # By sequence: (position, the target's final hidden state there [H]).
        self.last: dict[int, tuple[int, torch.Tensor]] = {}

    def observe(self, seqs: list[Sequence], starts: list[int], hidden: list[torch.Tensor]) -> None:
        for seq, start, h in zip(seqs, starts, hidden):
            # A copy: the step's buffer is the next step's.
            self.last[seq.seq_id] = (start + len(h) - 1, h[-1, : self.head.hidden_size].clone())

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        widths = widths or [0] * len(seqs)
        ready = []
        for seq, k, w in zip(seqs, ks, widths):
            got = self.last.get(seq.seq_id)
            if got is not None and got[0] == seq.num_tokens - 2:
                ready.append((seq, min(k, self.head.num_heads), w, got[1]))
        if not ready:
            return
        ranked = self.dynamic_tree and any(s.params.greedy for s, *_ in ready)
        t = 1 + max([w for _, _, w, _ in ready] + [_RANKED_ALTERNATIVES if ranked else 0])
        tokens, probs = self.head.top(torch.stack([h for *_, h in ready]), t)  # [N, K, t] each
        tokens, probs = tokens.tolist(), probs.tolist()
        for i, (seq, k, w, _) in enumerate(ready):
            chain = [tokens[i][d][0] for d in range(k)]
            if ranked and seq.params.greedy:
                nodes = ranked_nodes(
                    [tuple(probs[i][d][: 1 + _RANKED_ALTERNATIVES]) for d in range(k)]
                )
                values = [v for v, *_ in nodes[:k]]
                budget = k if rows is None else rows(values)
                n, picked = chosen_nodes(nodes, budget)
                leaves = [(d, tokens[i][d - 1][1 + a]) for d, a in picked]
                seq.spec.set(chain[:n], leaves=leaves, depth=k, expected=sum(values[:budget]))
                continue
            # The static tree: each head's next w tokens, leaves at its depth (greedy only: the
            # policy gives sampled sequences no width).
            leaves = (
                [(d + 1, tok) for d in range(k) for tok in tokens[i][d][1 : 1 + w]] if w else None
            )
            seq.spec.set(chain, leaves=leaves)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        got = self.last.get(parent.seq_id)
        if got is not None:  # never written to: the child may share the row
            self.last[child.seq_id] = got

    def release(self, seq: Sequence) -> None:
        self.last.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.last, f"Medusa rows left for sequences {list(self.last)}"
