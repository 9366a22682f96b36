"""Lookahead decoding: drafts from the target's own Jacobi iterations and an n-gram pool.
Lossless (greedy identical to speculation off in a batch with prefix-cache hits and structured
output, sampling distribution unchanged), no state left behind, bad settings refused; tiny random
models."""

from __future__ import annotations

import itertools

import pytest
from spec_sampling import assert_speculation_keeps_distribution, model_continued
from test_spec_suffix import _texts
from test_speculative import _llm, fixed_speculation_costs  # noqa: F401 (autouse)

from inferd import SamplingParams
from inferd.config import SpeculativeConfig
from inferd.spec.lookahead import LookaheadProposer, NgramPool

LOOKAHEAD = {"method": "lookahead", "num_speculative_tokens": 6}


def test_greedy_identical_batched_with_prefix_hits_and_structured_output(tiny_llama_gguf):
    off = _llm(tiny_llama_gguf.path, max_num_batched_tokens=64)
    # Every sequence drafts 6 at every step: a random model's Jacobi guesses are rarely right,
    # and the adaptive policy would soon leave them unverified.
    on = _llm(tiny_llama_gguf.path, {**LOOKAHEAD, "adaptive_depth": False}, max_num_batched_tokens=64)
    want = _texts(off, 90)
    assert _texts(on, 90) == want
    stats = on.engine.get_stats()
    hits, accepted = stats.prefix_cache_hits_total, stats.spec_accepted_tokens
    assert 0 < accepted < stats.spec_draft_tokens
    on.engine.check_no_leaks()
    assert _texts(on, 90) == want  # every prompt now a prefix-cache hit
    assert stats.prefix_cache_hits_total > hits
    on.engine.check_no_leaks()


def test_jacobi_guesses_become_drafts(tiny_llama_gguf):
    """With no candidate from the pool, the drafts after the first step are the target's own
    outputs of the last verification's rows, moved past what was accepted."""
    llm = _llm(tiny_llama_gguf.path, {"method": "lookahead", "num_speculative_tokens": 4, "adaptive_depth": False})
    proposer = llm.engine.proposer
    proposer.pools.best = lambda pool, first: ()
    log: list[tuple[str, int, list[int]]] = []

    def propose(seqs, ks, *args, **kwargs):
        LookaheadProposer.propose(proposer, seqs, ks, *args, **kwargs)
        log.extend(("draft", s.num_tokens, list(s.spec.token_ids)) for s in seqs)

    def verified(seq, row_argmax):
        log.append(("rows", seq.num_tokens, list(row_argmax)))
        LookaheadProposer.verified(proposer, seq, row_argmax)

    proposer.propose, proposer.verified = propose, verified
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [11, 23, 5, 67]}], params, use_tqdm=False)
    checked = 0
    for (kind, size, rows), (next_kind, next_size, draft) in itertools.pairwise(log):
        if kind != "rows" or next_kind != "draft":
            continue
        # Accepted: rows[:m + 1] became real tokens (the size grew by m + 1); the rest of the
        # rows are the guesses for the positions after them (as many as max_tokens leaves room for).
        m = next_size - size - 1
        n = min(len(draft), len(rows) - m - 1)
        assert draft[:n] == rows[m + 1 : m + 1 + n]
        checked += n > 0
    assert checked >= 3
    del proposer.propose, proposer.verified
    llm.engine.check_no_leaks()


def test_pool_keeps_the_most_seen_continuations():
    pool: dict = {}
    rules = NgramPool(n=3, guesses=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7)]:  # (1, 4, 5) seen least: dropped
        rules.add(pool, ngram)
    assert pool == {1: {(2, 3): 2, (6, 7): 1}}
    assert rules.best(pool, 1) == (2, 3)
    rules.add(pool, (1, 6, 7))  # a tie: the latest wins
    assert rules.best(pool, 1) == (6, 7)
    assert rules.best(pool, 9) == ()


def test_sampling_keeps_the_distribution(tiny_llama_gguf):
    """At temperature 0.8 with penalties and min_p, token frequencies at every verified position
    match speculation off (chi-square test). The model's own greedy text seeds the pool with
    n-grams the model is likely to say next: some drafts are accepted and some are not."""
    params = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.2, max_tokens=4, ignore_eos=True)  # fmt: skip
    spec = {"method": "lookahead", "num_speculative_tokens": 3, "lookahead_ngram": 2}
    stats = assert_speculation_keeps_distribution(tiny_llama_gguf.path, spec, params,
                                                  model_continued(tiny_llama_gguf.path, 64))  # fmt: skip
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats


@pytest.mark.parametrize("value, message", [
    ('{"method": "lookahead", "lookahead_window": 0}', "lookahead_window must be"),
    ('{"method": "lookahead", "lookahead_window": 2.5}', "lookahead_window must be"),
    ('{"method": "lookahead", "lookahead_ngram": 1}', "lookahead_ngram must be"),
    ('{"method": "lookahead", "lookahead_ngram": 9}', "lookahead_ngram must be"),
    ('{"method": "lookahead", "lookahead_guesses": 0}', "lookahead_guesses must be"),
    ('{"method": "lookahead", "lookahead_guesses": true}', "lookahead_guesses must be"),
    ('{"method": "lookahead", "lookahead_window": 12, "lookahead_ngram": 8}', "must be <= 16"),
    ('{"method": "lookahead", "num_speculative_tokens": 2, "lookahead_ngram": 5}', "lookahead_ngram - 1"),
    ('{"method": "lookahead", "num_speculative_tokens": 1}', "lookahead_ngram - 1"),
    ('{"method": "lookahead", "num_speculative_tokens": 17}', "num_speculative_tokens"),
    ('{"method": "lookahead", "model": "x.gguf"}', "takes no \"model\""),
    ('{"method": "ngram", "lookahead_window": 4}', "only for method \"lookahead\""),
    ('{"method": "lookahead", "lookahead_windows": 4}', "unknown keys"),
])  # fmt: skip
def test_bad_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_defaults():
    spec = SpeculativeConfig.parse('{"method": "lookahead"}')
    w, n, g = spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_guesses
    assert (w, n, g, spec.num_speculative_tokens) == (3, 3, 4, 5)
    spec = SpeculativeConfig.parse('{"method": "lookahead", "num_speculative_tokens": 10}')
    assert (spec.lookahead_window, spec.num_speculative_tokens) == (8, 10)
    spec = SpeculativeConfig.parse('{"method": "lookahead", "lookahead_window": 2, "lookahead_ngram": 3}')
    assert spec.num_speculative_tokens == 4
