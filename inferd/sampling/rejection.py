"""Verification of speculative draft tokens: which drafts the target accepts, and the token that
follows them. Lossless by construction:

- greedy sequences accept a draft while it equals the target's argmax; the first mismatch (or,
  when all k are accepted, the bonus row) emits the target's own token — exactly what decoding one
  token at a time would produce;
- sampling sequences use rejection sampling (Leviathan et al., 2023): draft x_i drawn from q_i is
  kept with probability min(1, p_i(x) / q_i(x)); on the first rejection the token is drawn from
  norm(max(0, p_i - q_i)). A deterministic proposer (prompt lookup, greedy draft heads) is a
  point-mass q: keep with probability p_i(x), else draw from p_i with x removed. Each emitted
  token is then distributed exactly as p, the target's distribution after every logits
  processor, temperature, top-k / top-p and min-p — applied to draft rows as if each draft had
  already been generated (penalties see the drafts before it, min_tokens counts them).
- a greedy sequence's draft-tree leaves (`seq.spec.leaves`: alternatives to the draft at some
  depth, each scored in a row of its own after the chain's rows): when the chain is rejected at
  depth d, a leaf at d equal to the target's token there is accepted, and its row's argmax
  follows it — again what one-at-a-time decoding emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.readbacks import HostReadbacks
from inferd.sampling.processors import apply_processors
from inferd.sampling.sampler import TokenLogprob, argmax_rows, draw, sampling_distribution, token_logprob
from inferd.scheduler.sequence import Sequence


class DraftView:
    """A sequence as it would be after `extra` more generated tokens: what the logits processors
    read (params, token history, output count) for a row that follows some draft tokens."""

    __slots__ = ("seq", "extra")

    def __init__(self, seq: Sequence, extra: list[int]) -> None:
        self.seq = seq
        self.extra = extra

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.extra if self.extra else self.seq.token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra


@dataclass(slots=True)
class Verified:
    token_ids: list[int]  # accepted drafts followed by one token of the target's own
    logprobs: list[TokenLogprob | None]
    num_accepted: int  # drafts among token_ids, an accepted leaf included
    leaf: int | None = None  # index into seq.spec.leaves of the accepted leaf
    # The target's argmax after each of the chain's 1 + k rows (after every logits processor),
    # accepted or not: beyond a rejection, a Jacobi update of the drafts (inferd.spec.lookahead).
    row_argmax: list[int] | None = None


def draft_views(seq: Sequence) -> list[DraftView]:
    """One view per verification row: row i follows the first i drafts; then a row per leaf
    (depth d: after the first d - 1 drafts and the leaf)."""
    drafts = seq.spec.token_ids
    views = [DraftView(seq, drafts[:i]) for i in range(len(drafts) + 1)]
    return views + [DraftView(seq, drafts[: d - 1] + [t]) for d, t in seq.spec.leaves]


def _uniform(gen: torch.Generator | None, device: torch.device) -> float:
    return torch.rand((), generator=gen, device=device).item()


def verify(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...], vocab_size: int,
    readbacks: HostReadbacks | None = None,
) -> list[Verified]:
    """logits: [sum(1 + k_s + leaves_s), V] fp32, each sequence's 1 + k rows in order, then a row
    per leaf; `seq.spec.token_ids` are its drafts, `seq.spec.probs` the draft distributions (None:
    deterministic drafts), `seq.spec.leaves` the leaves of a draft tree (greedy sequences)."""
    if logits.shape[-1] > vocab_size:
        logits = logits[:, :vocab_size]
    views = [v for s in seqs for v in draft_views(s)]
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
    processed = apply_processors(logits, views, eos_token_ids)
    targets = (readbacks or HostReadbacks()).to_host(argmax_rows(processed))
    random_rows = [i for i, v in enumerate(views) if not v.params.greedy]
    probs = None
    if random_rows:
        probs = torch.zeros_like(processed)
        probs[random_rows] = sampling_distribution(processed[random_rows], [views[i] for i in random_rows])

    results: list[Verified] = []
    row = 0
    for seq in seqs:
        drafts = seq.spec.token_ids
        k = len(drafts)
        leaf = None
        if seq.params.greedy:
            m = 0
            while m < k and drafts[m] == targets[row + m]:
                m += 1
            tokens = drafts[:m] + [targets[row + m]]
            rows = list(range(row, row + m + 1))
            # Rejected at depth m + 1: a leaf there that is the target's own token is accepted
            # too, and its row gives the token after it.
            for i, (depth, token) in enumerate(seq.spec.leaves):
                if depth == m + 1 and token == tokens[-1]:
                    leaf, m = i, m + 1
                    rows.append(row + k + 1 + i)
                    tokens.append(targets[rows[-1]])
                    break
        else:
            assert not seq.spec.leaves, "draft-tree leaves are verified for greedy sequences only"
            tokens = _rejection_sample(probs[row : row + k + 1], seq, drafts)
            m = len(tokens) - 1
            rows = list(range(row, row + m + 1))
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if raw_logprobs is not None and seq.params.logprobs is not None:
            n_top = seq.params.logprobs
            logprobs = [token_logprob(raw_logprobs[r], t, n_top) for r, t in zip(rows, tokens)]
        results.append(Verified(tokens, logprobs, m, leaf, targets[row : row + k + 1]))
        row += k + 1 + len(seq.spec.leaves)
    return results


def _rejection_sample(p: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[int]:
    """p: [k + 1, V] the target's distributions for the rows of one sequence."""
    q = seq.spec.probs
    gen = seq.generator
    for i, x in enumerate(drafts):
        q_x = 1.0 if q is None else q[i, x].item()
        p_x = p[i, x].item()
        if q_x > 0 and _uniform(gen, p.device) * q_x < p_x:  # u < p/q, without dividing
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_(min=0.0)
        if not bool((residual > 0).any()):  # p == q up to rounding: nothing to correct
            residual = p[i]
        return drafts[:i] + [int(draw(residual.unsqueeze(0), [seq])[0])]
    return drafts + [int(draw(p[len(drafts)].unsqueeze(0), [seq])[0])]
