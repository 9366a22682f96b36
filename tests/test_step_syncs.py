"""Device→host readbacks per step (inferd/engine/readbacks.py), counted on the CPU: a decode step
reads back once (its tokens), whatever the sampling parameters; a GPU run checks the same with
CUDA's sync debug mode (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest

from inferd import LLM
from inferd.sampling.params import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True),
]


@pytest.fixture(scope="module")
def engine(tiny_models):
    llm = LLM(str(tiny_models["llama-q8_0.gguf"].path), dtype="float32", device="cpu", verbose=False,
              kv_cache_memory=1 << 20)  # fmt: skip
    return llm.engine


def readbacks_per_step(engine, params: list[SamplingParams]) -> list[int]:
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1, 5, 9, 13, 17, 21], p)
    counts = []
    while engine.has_unfinished_requests():
        before = engine.runner.readbacks.count
        engine.step()
        counts.append(engine.runner.readbacks.count - before)
    for i in range(len(params)):
        engine.pop_finished(f"r{i}")
    engine.check_no_leaks()
    return counts


def test_one_readback_per_step_whatever_the_sampling(engine):
    counts = readbacks_per_step(engine, PARAMS)
    assert len(counts) == 12  # one prefill step (sampling every first token), 11 decodes
    assert counts == [1] * 12


def test_verification_reads_back_once(tiny_models):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 8}  # fmt: skip
    llm = LLM(str(tiny_models["llama-q8_0.gguf"].path), dtype="float32", device="cpu", verbose=False,
              kv_cache_memory=1 << 20, speculative_config=spec, max_num_seqs=2)  # fmt: skip
    engine = llm.engine
    prompt = engine.tokenizer.encode("the cat sat on the mat and the cat sat on the hat so the cat") * 3
    engine.add_request("v", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        before = engine.runner.readbacks.count
        engine.step()
        counts.append(engine.runner.readbacks.count - before)
    assert engine.stats.spec_draft_tokens > 0
    assert counts == [1] * len(counts)


def test_bucketed_decode_step_uploads_once_and_reads_back_once(tiny_models):
    """Decode-only steps in buckets (inferd/engine/decode_buckets.py, as CUDA runs them): the
    step's metadata goes up in one copy, its tokens come back in one readback."""
    llm = LLM(str(tiny_models["llama-q8_0.gguf"].path), dtype="float32", device="cpu", verbose=False,
              kv_cache_memory=1 << 20, max_num_seqs=4, kv_cache_prefault=0)  # fmt: skip
    engine = llm.engine
    engine.runner.enable_decode_buckets(4, engine.max_model_len, cuda_graphs=False)
    buckets = engine.runner.buckets
    for i, p in enumerate(PARAMS[:3]):
        engine.add_request(f"u{i}", [1, 5, 9, 13, 17, 21], p)
    engine.step()  # the prefills
    counts = []
    while engine.has_unfinished_requests():
        reads, uploads = engine.runner.readbacks.count, buckets.uploads
        engine.step()
        counts.append((engine.runner.readbacks.count - reads, buckets.uploads - uploads))
    assert counts == [(1, 1)] * 11
