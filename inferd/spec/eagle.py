"""Learned draft head proposals (EAGLE-style): a small network reads the target's final hidden
state at the last accepted position and the embedding of the token that followed, attends over
the same pairs at every earlier position, predicts the next hidden state, and the target's own LM
head turns it into a draft token; chained k times. The head is trained by
`python -m inferd.train.train_eagle`.

Per sequence the proposer keeps the head's keys and values of every position the target computed
(a `DraftCache`, fed by `observe` after each step from the target's hidden states of the step's
rows: prompt chunks, plain decodes, the accepted part of verifications). Positions the target did
not compute for this sequence (a prompt prefix served from the prefix cache) are not in it: the
head then attends over the positions it has.

Observing is deferred until the sequence drafts: `observe` only keeps the step's hidden states
(`_Pending`), and `propose` feeds the chosen sequences' caches first, in one batched pass. A step
where the policy lets no sequence speculate (a large batch, a head that does not pay on this
model) then costs what it costs without speculation: feeding the caches there was 0.17 ms of a
2.8 ms `-q auto` step. A sequence that keeps not speculating has its rows fed `_MAX_PENDING` at a
time, so what it holds stays bounded and the head's weights are read once per batch of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferd.scheduler.sequence import Sequence
from inferd.spec.draft_tree import chosen_nodes, ranked_nodes
from inferd.spec.draft_cache import DraftCache
from inferd.spec.proposer import Proposer, ProposerContext



# Rows a sequence may hold unobserved before they are fed anyway (2.3 KB each at the default
# model's hidden size).
_MAX_PENDING = 64
# Positions the start-up warm-up grows the head's rotary tables to (8,192: 3 ms, 4 MB); longer
# sequences grow them once more when they get there.
_WARM_POSITIONS = 8192


@dataclass(slots=True)
class _Pending:
    """Positions [start, end) of one sequence that the head's cache has not seen yet: the
    target's hidden states there and the token after each."""

    start: int
    end: int
    hidden: list[torch.Tensor] = field(default_factory=list)
    nexts: list[int] = field(default_factory=list)

    def add(self, start: int, hidden: torch.Tensor, nexts: list[int]) -> bool:
        """Append rows from `start`; False when they do not continue (or rewrite) these."""
        if not self.start <= start <= self.end:
            return False
        if start < self.end:  # recomputed positions (after a preemption) replace the old rows
            keep = start - self.start
            rows = torch.cat(self.hidden)[:keep]
            self.hidden = [rows] if keep else []
            del self.nexts[keep:]
        self.hidden.append(hidden)
        self.nexts.extend(nexts)
        self.end = start + len(hidden)
        return True


class EagleProposer(Proposer):
    method = "eagle"
    needs_hidden = True

    def __init__(self, ctx: ProposerContext) -> None:
        spec = ctx.spec
        from inferd.spec.eagle_head import EagleHead

        # int4 linears on the CPU (the engine's packed tiles): a draft step streams every weight
        # of the head, k times per target step; drafts are only proposals, verification decides.
        self.head = EagleHead.load(spec.model, ctx.target, ctx.device, ctx.dtype, quantize=True)
        # The target keeps the outputs of the layers the head reads beside its final hidden
        # state (EAGLE-3's features); the runner hands them over after it in each row.
        ctx.target.capture_layers = self.head.feature_layers
        # Greedy chains spend their rows on the likeliest nodes of the chain and each depth's
        # runner-up and third (inferd.spec.draft_tree), as many as the engine's `rows` says,
        # unless a fixed draft tree is asked for (draft_topk > 1).
        self.dynamic_tree = spec.dynamic_tree and spec.draft_topk == 1
        self.ranks_drafts = self.dynamic_tree
        self.caches: dict[int, DraftCache] = {}
        self.pending: dict[int, _Pending] = {}  # by sequence: rows not yet in its cache
        self._warm_up(ctx.max_model_len, spec.num_speculative_tokens, ctx.device, ctx.dtype)

    @torch.inference_mode()
    def _warm_up(self, max_model_len: int, k: int, device: torch.device, dtype: torch.dtype) -> None:
        """A feed and a chain on a throwaway cache, near the last position a sequence reaches
        (at most _WARM_POSITIONS). The head's first calls build what it keeps (the C++ chain's
        weights, rotary tables grown to the positions reached): ~11 ms at the default model,
        which the policy charged to the first speculating step as drafting's own time; on a
        short step that priced every depth out (SpecPolicy)."""
        head, n = self.head, 4
        end = max(n, min(max_model_len, _WARM_POSITIONS) - k)
        positions = torch.arange(end - n, end, device=device)
        hidden = torch.zeros(n, head.input_size, device=device, dtype=dtype)
        x, keys, values = head.cache_entries(hidden, torch.zeros_like(positions), positions)
        cache = DraftCache(keys, head.num_kv_heads, head.head_dim)
        cache.write(end - n, x, keys, values)
        head.draft([cache], k, confidences=self.ranks_drafts)

    @torch.inference_mode()  # as propose: the caches' buffers are inference tensors
    def observe(self, seqs: list[Sequence], starts: list[int], hidden: list[torch.Tensor]) -> None:
        full = []
        for seq, start, h in zip(seqs, starts, hidden):
            # The token after each position: all known once the step's tokens are appended. The
            # rows are copied: the step's buffer is the next step's.
            nexts = seq.token_ids[start + 1 : start + 1 + len(h)]
            rows = h.clone()
            pending = self.pending.get(seq.seq_id)
            if pending is not None and not pending.add(start, rows, nexts):
                self._feed([seq])  # a gap: what came before goes in first
                pending = None
            if pending is None:
                pending = self.pending[seq.seq_id] = _Pending(start, start + len(h), [rows], nexts)
            if pending.end - pending.start >= _MAX_PENDING:
                full.append(seq)
        if full:
            self._feed(full)

    @torch.inference_mode()
    def _feed(self, seqs: list[Sequence]) -> None:
        """Write the pending rows of `seqs` into their caches, all in one pass of the head."""
        todo = [(seq, p) for seq in seqs if (p := self.pending.pop(seq.seq_id, None)) is not None]
        if not todo:
            return
        head = self.head
        # One sequence's one step (the usual case at batch 1) needs no cats.
        hidden = [h for _, p in todo for h in p.hidden]
        rows = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        if len(todo) == 1:
            positions = torch.arange(todo[0][1].start, todo[0][1].end, device=rows.device)
        else:
            positions = torch.cat([torch.arange(p.start, p.end) for _, p in todo]).to(rows.device)
        nexts = torch.tensor([t for _, p in todo for t in p.nexts], device=rows.device)
        x, k, v = head.cache_entries(rows, nexts, positions)
        at = 0
        for seq, p in todo:
            n = p.end - p.start
            cache = self.caches.get(seq.seq_id)
            if cache is None:
                cache = self.caches[seq.seq_id] = DraftCache(k, head.num_kv_heads, head.head_dim)
            cache.write(p.start, x[at : at + n], k[at : at + n], v[at : at + n])
            at += n

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        # A chain starts at the position before the last token: its entry pairs the target's
        # hidden state there with that token.
        widths = widths or [0] * len(seqs)
        self._feed(seqs)
        ready = [(s, k, w) for s, k, w in zip(seqs, ks, widths)
                 if (c := self.caches.get(s.seq_id)) is not None and c.end == s.num_tokens - 1]  # fmt: skip
        if not ready:
            return
        width = max(w for *_, w in ready)
        caches = [self.caches[s.seq_id] for s, *_ in ready]
        # Ranked drafting stops once every chain has settled by the tree's rule, so a sampled
        # sequence beside greedy ones may get a shorter chain (fewer drafts, verified losslessly).
        ranked = self.dynamic_tree and any(s.params.greedy for s, *_ in ready)
        drafted, extra = self.head.draft(caches, max(k for _, k, _ in ready), alternatives=width,
                                         confidences=ranked)  # fmt: skip
        if ranked:
            others, probs = extra[0].tolist(), extra[1].tolist()
        alts = extra.tolist() if width else None
        for i, ((seq, k, w), row) in enumerate(zip(ready, drafted.tolist())):
            if ranked and seq.params.greedy:
                nodes = ranked_nodes(probs[i][:k])
                values = [v for v, *_ in nodes[:k]]
                budget = k if rows is None else rows(values)
                chain, picked = chosen_nodes(nodes, budget)
                leaves = [(d, others[i][d - 1][a]) for d, a in picked]
                seq.spec.set(row[:chain], leaves=leaves, depth=k, expected=sum(values[:budget]))
                continue
            # A draft tree: the head's next w likeliest tokens at each depth, leaves off the chain.
            leaves = [(d + 1, t) for d in range(k) for t in alts[i][d][:w]] if w else None
            seq.spec.set(row[:k], leaves=leaves)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        cache = self.caches.get(parent.seq_id)
        if cache is not None:
            self.caches[child.seq_id] = cache.copy()
        pending = self.pending.get(parent.seq_id)
        if pending is not None:  # the rows are never written to: the child may share them
            self.pending[child.seq_id] = _Pending(
                pending.start, pending.end, list(pending.hidden), list(pending.nexts)
            )

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)
        self.pending.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.caches, f"draft head caches left for sequences {list(self.caches)}"
        assert not self.pending, f"unobserved rows left for sequences {list(self.pending)}"
