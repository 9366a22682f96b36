"""Prompt lookup (n-gram) proposals: no model. The last n tokens of a sequence are looked up in its
own prompt and output; what followed their latest earlier occurrence is the draft. Pays off when
the output copies its input (rewriting, summarising, code edits, quoting)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from inferd.scheduler.sequence import Sequence
from inferd.spec.proposer import Proposer


def lookup(token_ids: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` (n_max down to n_min tokens long) found elsewhere in it; [] when none."""
    tokens = np.asarray(token_ids)
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        # Windows starting at 0 .. size - n - 1: every earlier occurrence, followed by >= 1 token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        for seq, k in zip(seqs, ks):
            seq.set_drafts(lookup(seq.token_ids, k, self.n_min, self.n_max))
