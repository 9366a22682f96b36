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


class NgramIndex:
    """`lookup` for one growing sequence, kept up to date as tokens are appended: per n-gram
    length, the latest start of every n-gram that is followed by at least one token. A lookup is
    then a few dictionary reads instead of scans of the whole sequence: `lookup` took 140-275 µs
    a call at 100-1,000 tokens (numpy, three suffix lengths that miss), ~4 % of a `-q auto` step
    at batch 1 and paid again by every sequence of a batch that may speculate."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # One entry per position and length (~100 bytes each): built only for sequences the
        # policy lets speculate, freed with the sequence.
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.size = 0  # tokens indexed

    def extend(self, token_ids: list[int]) -> None:
        """Index the tokens appended since the last call (a sequence's tokens only ever grow)."""
        if len(token_ids) < self.size:  # never expected: start over rather than draft stale text
            for latest in self.latest.values():
                latest.clear()
            self.size = 0
        for size in range(self.size + 1, len(token_ids) + 1):
            # At `size` tokens, n-grams starting at <= size - 1 - n are followed by a token.
            for n, latest in self.latest.items():
                i = size - 1 - n
                if i >= 0:
                    latest[tuple(token_ids[i : i + n])] = i
        self.size = len(token_ids)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """What `lookup(token_ids, k, n_min, n_max)` returns."""
        self.extend(token_ids)
        size = len(token_ids)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            i = self.latest[n].get(tuple(token_ids[size - n :]))
            if i is not None:
                return token_ids[i + n : i + n + k]
        return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.indexes: dict[int, NgramIndex] = {}  # seq_id -> its index, built on its first lookup

    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        for seq, k in zip(seqs, ks):
            index = self.indexes.get(seq.seq_id)
            if index is None:
                index = self.indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
            seq.spec.set(index.lookup(seq.token_ids, k))

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.indexes, f"n-gram indexes of finished sequences: {sorted(self.indexes)}"
