"""Suffix decoding: drafts from the request's own text and from other requests' (a shared index,
bounded, per cache salt). Lossless (greedy identical to speculation off in a batch with
prefix-cache hits and structured output, sampling distribution unchanged), bounded, isolated
between tenants; tiny random models."""

from __future__ import annotations

import random

import pytest
from spec_sampling import assert_speculation_keeps_distribution, model_continued
from test_speculative import _llm, fixed_speculation_costs  # noqa: F401 (autouse)

from inferd import SamplingParams
from inferd.config import SpeculativeConfig
from inferd.spec import suffix_cache
from inferd.spec.suffix import SuffixProposer, draft_from
from inferd.spec.suffix_cache import SuffixCache
from inferd.structured import StructuredOutputsParams

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def _requests(length: int = 40) -> tuple[list[dict], list[SamplingParams]]:
    """Greedy requests, two of them the same, one under a grammar, one with n = 2; `length`
    tokens long (a longer text lets a random model repeat itself, so more drafts are accepted)."""
    base = [11, 23, 5, 67, 8, 90, 12, 34, 5, 67, 8, 41, 2, 9, 77, 31]
    prompts = [base, list(range(5, 40)), base, base[:9] + [3, 4, 5, 3, 4, 5], base * 2]
    params = [
        SamplingParams(temperature=0, max_tokens=length, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=length - 7, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=length, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutputsParams(regex="[ab]{4,9}")),
        SamplingParams(temperature=0, max_tokens=3 * length // 4, ignore_eos=True, n=2, repetition_penalty=1.2),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def _texts(llm, length: int = 40) -> list[list[list[int]]]:
    outs = llm.generate(*_requests(length), use_tqdm=False)
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_greedy_identical_batched_with_prefix_hits_and_structured_output(tiny_llama_gguf):
    off = _llm(tiny_llama_gguf.path, max_num_batched_tokens=64)
    on = _llm(tiny_llama_gguf.path, SUFFIX, max_num_batched_tokens=64)
    want = _texts(off)
    assert _texts(on) == want
    stats = on.engine.get_stats()  # the engine's own record, updated in place
    hits, drafted, accepted = stats.prefix_cache_hits_total, stats.spec_draft_tokens, stats.spec_accepted_tokens
    assert accepted > 0
    # Again: every prompt now a prefix-cache hit, every answer in the shared index.
    assert _texts(on) == want
    assert stats.prefix_cache_hits_total > hits
    drafted = stats.spec_draft_tokens - drafted
    accepted = stats.spec_accepted_tokens - accepted
    assert accepted > 0.9 * drafted > 0, (accepted, drafted)
    on.engine.check_no_leaks()


# ---- the shared index --------------------------------------------------------------------------

def _brute_match(docs: list[list[int]], context: list[int], max_depth: int) -> tuple[int, set]:
    """The longest match (>= 2 tokens, <= max_depth) of context's end followed by a token in
    any document, by scanning, and every (document, continuation position) with it."""
    best, found = 0, set()
    for i, doc in enumerate(docs):
        for c in range(1, len(doc)):
            m = 0
            while m < min(max_depth, c, len(context)) and doc[c - 1 - m] == context[-1 - m]:
                m += 1
            if m >= 2 and m > best:
                best, found = m, {(i, c)}
            elif m >= 2 and m == best:
                found.add((i, c))
    return best, found


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_index_finds_what_scanning_finds(vocab, monkeypatch):
    """Every longest match and its places, against a scan of every document, as documents grow,
    finish, merge and are evicted (small vocabularies: many matches and many misses), with sweeps
    of dropped documents' entries running all along."""
    monkeypatch.setattr(suffix_cache, "_MIN_STALE", 0)
    rng = random.Random(vocab)
    cache = SuffixCache(max_tokens=900, max_requests=6, max_depth=12)
    live: list = []
    for step in range(300):
        if len(live) < 3 or rng.random() < 0.1:
            live.append((cache.open(None), []))
        doc, tokens = rng.choice(live)
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 5)))
        cache.extend(doc, tokens)
        if rng.random() < 0.1:
            cache.close(doc)
            live.remove((doc, tokens))
        held = list(cache._docs.values())
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        context = tokens[: rng.randrange(len(tokens) + 1)] + context
        matched, found = cache.match(None, context)
        want_matched, want = _brute_match([d.tokens for d in held], context, 12)
        assert matched == want_matched
        if len(want) <= 64:  # the most recent 64 places are looked at
            assert {(held.index(d), c) for d, c in found} == want, (step, context)
        cache.check_integrity()


@pytest.mark.parametrize("min_stale", [0, 1 << 14])
def test_index_stays_within_its_bounds(min_stale, monkeypatch):
    """Tokens and finished requests within their bounds whatever the traffic, and dropped
    documents' entries swept out; least recently used documents go first, a recurring one is
    merged (no memory), and a live document stops growing when only live documents are left to
    hold."""
    monkeypatch.setattr(suffix_cache, "_MIN_STALE", min_stale)
    rng = random.Random(0)
    cache = SuffixCache(max_tokens=2000, max_requests=8, max_depth=24)
    kept = cache.open(None)
    cache.extend(kept, [7] * 5 + list(range(100, 150)))
    cache.close(kept)
    for i in range(60):
        doc = cache.open(rng.choice([None, "tenant-a"]))
        tokens = [rng.randrange(1000) for _ in range(rng.randrange(20, 400))]
        for end in range(0, len(tokens) + 1, 37):
            cache.extend(doc, tokens[:end])
        cache.extend(doc, tokens)
        cache.close(doc)
        # Using the first document keeps it in (an LRU, not a FIFO).
        matched, found = cache.match(None, [7, 7, 100, 101])
        assert matched == 4 and found[0][0] is kept
        cache.touch(kept)
        cache.check_integrity()
        assert cache.num_tokens <= 2000 and cache.num_finished <= 8
    again = cache.open(None)
    cache.extend(again, kept.tokens)
    before = cache.num_tokens
    cache.close(again)  # the same tokens as a held document: merged into it
    assert kept.weight == 2 and cache.num_tokens == before - len(kept.tokens)
    long = cache.open(None)
    cache.extend(long, list(range(5000)))
    assert cache.num_tokens == 2000 and cache.num_finished == 0 and len(long.tokens) == 2000
    cache.close(long)
    cache.check_integrity()


def test_drafts_follow_the_most_frequent_continuation():
    cache = SuffixCache(max_tokens=1000, max_requests=10, max_depth=24)
    for tokens, times in (([1, 2, 3, 4, 5, 6], 3), ([1, 2, 3, 9, 9, 9], 1), ([8, 2, 3, 4, 5, 7], 1)):
        for _ in range(times):
            doc = cache.open(None)
            cache.extend(doc, tokens)
            cache.close(doc)
    matched, found = cache.match(None, [0, 2, 3])
    assert matched == 2 and len(found) == 3  # "2 3" in the three documents
    # 4 (weights 3 + 1) over 9 (1), then 5; then 6 (3) over 7 (1) until the estimate, 0.8 * 0.75,
    # falls below the floor.
    assert draft_from(found, 8, 0.1) == [4, 5, 6]
    assert draft_from(found, 8, 0.7) == [4, 5]
    assert draft_from(found, 8, 0.9) == []
    matched, found = cache.match(None, [1, 2, 3])  # the longest match wins: "1 2 3" (4 weighs 3, 9 1)
    assert matched == 3 and draft_from(found, 8, 0.1) == [4, 5, 6]
    assert draft_from(found, 2, 0.1) == [4, 5]


# ---- through the engine --------------------------------------------------------------------------

def _drafts(llm, prompt: list[int], salt: str | None) -> list[list[int]]:
    """Every draft proposed while a greedy request of `prompt` under `salt` runs alone."""
    proposer = llm.engine.proposer
    drafts: list[list[int]] = []

    def spy(seqs, ks, *args, **kwargs):
        SuffixProposer.propose(proposer, seqs, ks, *args, **kwargs)
        drafts.extend(list(s.spec.token_ids) for s in seqs)

    proposer.propose = spy
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, cache_salt=salt)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    del proposer.propose
    return drafts


def test_tenants_never_draft_from_each_others_text(tiny_llama_gguf):
    """A salted request drafts exactly what it drafts on an engine that never saw another salt's
    requests, though those wrote its very answer; under its own salt the answer is drafted."""
    prompt = [11, 23, 5, 67, 8, 90, 12, 34, 41, 2, 9, 77, 31]
    fixed = {**SUFFIX, "adaptive_depth": False}  # drafts at every step, k = 8
    seen = _llm(tiny_llama_gguf.path, fixed)
    fresh = _llm(tiny_llama_gguf.path, fixed)
    first = _drafts(seen, prompt, "tenant-a")
    again = _drafts(seen, prompt, "tenant-a")
    assert sum(map(len, again)) > sum(map(len, first)) + 16  # its own earlier answer
    for salt in ("tenant-b", None):
        assert _drafts(seen, prompt, salt) == _drafts(fresh, prompt, salt)
    assert seen.engine.proposer.cache.salts() == {"tenant-a", "tenant-b", None}
    seen.engine.check_no_leaks()


def test_sampling_keeps_the_distribution(tiny_llama_gguf):
    """At temperature 0.8 with penalties and min_p, drafts from the request's own text and from
    the other samples' (the shared index), token frequencies at every verified position match
    speculation off."""
    params = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.2, max_tokens=4, ignore_eos=True)  # fmt: skip
    spec = {"method": "suffix", "num_speculative_tokens": 3}
    stats = assert_speculation_keeps_distribution(tiny_llama_gguf.path, spec, params,
                                                  model_continued(tiny_llama_gguf.path, 64))  # fmt: skip
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats


@pytest.mark.parametrize("value, message", [
    ('{"method": "suffix", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "suffix", "num_speculative_tokens": -2}', "num_speculative_tokens"),
    ('{"method": "suffix", "suffix_decoding_max_depth": 8}', "unknown keys"),
    ('{"method": "suffix", "model": "x.gguf"}', "takes no \"model\""),
    ('{"method": "ngram", "suffix_decoding_min_token_prob": 0.2}', "only for method \"suffix\""),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}', "max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob"),
    ('{"method": "suffix", "suffix_decoding_max_cached_tokens": -1}', "max_cached_tokens"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": "10"}', "max_cached_requests"),
])  # fmt: skip
def test_bad_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_suffix_drafts_sixteen_by_default():
    assert SpeculativeConfig.parse('{"method": "suffix"}').num_speculative_tokens == 16
    assert SpeculativeConfig.parse('{"method": "ngram"}').num_speculative_tokens == 3
