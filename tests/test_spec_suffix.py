"""Suffix decoding: drafts from the request's own text and from other requests' (a shared index,
bounded, per cache salt). Lossless (greedy identical to speculation off in a batch with
prefix-cache hits and structured output, sampling distribution unchanged), bounded, isolated
between tenants; tiny random models."""

from __future__ import annotations

import random

import pytest
from test_speculative import _llm, _token_histograms, fixed_speculation_costs  # noqa: F401 (autouse)

from inferd import SamplingParams
from inferd.config import SpeculativeConfig
from inferd.spec.suffix import draft_from
from inferd.spec.suffix_cache import SuffixCache
from inferd.structured import StructuredOutputsParams

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def _requests() -> tuple[list[dict], list[SamplingParams]]:
    """Greedy requests, two of them the same, one under a grammar, one with n = 2."""
    base = [11, 23, 5, 67, 8, 90, 12, 34, 5, 67, 8, 41, 2, 9, 77, 31]
    prompts = [base, list(range(5, 40)), base, base[:9] + [3, 4, 5, 3, 4, 5], base * 2]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutputsParams(regex="[ab]{4,9}")),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2, repetition_penalty=1.2),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def _texts(llm) -> list[list[list[int]]]:
    outs = llm.generate(*_requests(), use_tqdm=False)
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
