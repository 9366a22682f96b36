"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding") in the verification chain: drafts from the target's own Jacobi iterations and
an n-gram pool built from them; no draft model, no training.

What is built is one chain of rows per sequence on the engine's ordinary verification path, not
the paper's 2-D window with an attention mask of its own:

    rows:   t  |  c_1 .. c_{N-1}  |  g .. g        (t: the last real token, at position p)
                  a candidate        the Jacobi window's guesses for the positions after it

- the candidate: of the pool's n-grams whose first token is t (at most G kept per first token,
  the least seen dropped first), the one seen most often, the latest on ties. None: the window
  starts at p + 1.
- the window: one guess per future position, W of them after a candidate (k rows in all at most).
  Every verification row yields the target's token after its own (`Verified.row_argmax`); past
  the first rejected draft that is a Jacobi update of the next position, conditioned on the
  guesses before it, and it becomes that position's guess for the next step. A position never
  guessed starts from a token of the sequence's own text (the paper starts from the prompt's).
- the pool: a row's output appended to the history of the token the row fed (the guesses and
  outputs that led to it across steps, each predicted right after the one before it: the
  paper's diagonal through its window's levels) is an n-gram once N tokens long, keyed by its
  first. Accepted rows add the real text's n-grams, and the context's n-grams seed the pool at a
  sequence's first draft (the lookahead reference implementation's pool from the prompt), so a
  phrase the answer repeats is a candidate too.

Acceptance is the verifier's: lossless (greedy tokens identical; sampling by the rejection rule,
the drafts being point masses). A rejected guess is not wasted: its row is the next Jacobi
iteration. What the 2-D window has and this has not: lookahead rows apart from the verified ones
(W x (N - 1), their KV dropped) and G candidates verified side by side in one step. Here the
window and one candidate share the chain's k rows, and the depth policy gates the whole chain by
its acceptance (inferd.spec.policy), as for every proposer.

State is per sequence (pool and window), freed when the sequence leaves.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.config import SpeculativeConfig
from inferd.scheduler.sequence import Sequence
from inferd.spec.proposer import Proposer

History = tuple[int, ...]  # up to N - 1 tokens at consecutive positions, ending in a given one


@dataclass(slots=True)
class _State:
    # first token -> {the N - 1 tokens after it: times seen}, in order of last sight (latest last)
    pool: dict[int, dict[History, int]] = field(default_factory=dict)
    guesses: dict[int, tuple[int, History]] = field(default_factory=dict)  # position -> guess
    fed_at: int = -1  # position of the last drafted chain's first row (its real token)
    fed: list[History] = field(default_factory=list)  # the history of each row's token
    seeded: bool = False

    def copy(self) -> _State:
        return _State({t: dict(c) for t, c in self.pool.items()}, dict(self.guesses), self.fed_at,
                      list(self.fed), self.seeded)  # fmt: skip


class NgramPool:
    """The pool's rules, over a `_State.pool`: at most `guesses` continuations per first token."""

    def __init__(self, n: int, guesses: int) -> None:
        self.n = n
        self.guesses = guesses

    def add(self, pool: dict[int, dict[History, int]], ngram: History) -> None:
        """One sighting of an n-gram (N tokens)."""
        conts = pool.setdefault(ngram[0], {})
        rest = ngram[1:]
        conts[rest] = conts.pop(rest, 0) + 1  # moved to the end: the latest
        if len(conts) > self.guesses:  # the least seen goes, the oldest of those
            del conts[min(conts, key=conts.__getitem__)]

    def best(self, pool: dict[int, dict[History, int]], first: int) -> History:
        """The continuation of `first` seen most often, the latest on ties; () when none."""
        best, best_count = (), 0
        for rest, count in pool.get(first, {}).items():
            if count >= best_count:
                best, best_count = rest, count
        return best


class LookaheadProposer(Proposer):
    method = "lookahead"
    wants_row_argmax = True

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.n = spec.lookahead_ngram
        self.window = spec.lookahead_window
        self.pools = NgramPool(spec.lookahead_ngram, spec.lookahead_guesses)
        self.states: dict[int, _State] = {}
        self.rng = random.Random(0)  # the first guesses: a draft's value never changes an output

    def _state(self, seq: Sequence) -> _State:
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = _State()
        if not state.seeded:
            tokens, n = seq.token_ids, self.n
            for i in range(len(tokens) - n + 1):
                self.pools.add(state.pool, tuple(tokens[i : i + n]))
            state.seeded = True
        return state

    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        n = self.n
        for seq, k in zip(seqs, ks):
            state = self._state(seq)
            tokens = seq.token_ids
            p = len(tokens) - 1  # the last real token's position: row 0
            real = tuple(tokens[-(n - 1) :])
            state.guesses = {q: g for q, g in state.guesses.items() if q > p}
            size = min(k, n - 1 + self.window)
            candidate = self.pools.best(state.pool, tokens[-1])[:size]
            draft = list(candidate)
            fed = [real] + [(real + candidate[: i + 1])[-(n - 1) :] for i in range(len(candidate))]
            for q in range(p + 1 + len(draft), p + 1 + size):
                guess = state.guesses.get(q)
                if guess is None:
                    token = self.rng.choice(tokens)
                    guess = (token, (token,))
                draft.append(guess[0])
                fed.append(guess[1])
            state.fed_at, state.fed = p, fed
            seq.spec.set(draft)

    def verified(self, seq: Sequence, row_argmax: list[int]) -> None:
        """Each row's output: an n-gram for the pool and the next step's guess at its position."""
        state = self.states[seq.seq_id]
        n, p = self.n, state.fed_at
        for i, (history, token) in enumerate(zip(state.fed, row_argmax)):
            ngram = history + (token,)
            if len(ngram) >= n:
                self.pools.add(state.pool, ngram[-n:])
            state.guesses[p + i + 1] = (token, ngram[-(n - 1) :])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        state = self.states.get(parent.seq_id)
        if state is not None:
            self.states[child.seq_id] = state.copy()

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.states, f"lookahead state of finished sequences: {sorted(self.states)}"
