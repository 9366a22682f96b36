"""Decode-only steps padded to bucket sizes over persistent inputs (inferd/engine/decode_buckets.py),
run eagerly on the CPU: the same greedy tokens as the plain step, and padded rows write nothing
but the scratch block."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM
from inferd.engine.decode_buckets import bucket_for, bucket_sizes
from inferd.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_llm(path: str, buckets: bool) -> LLM:
    llm = LLM(path, dtype="float32", device="cpu", verbose=False, kv_cache_memory=1 << 20,
              max_num_seqs=8, kv_cache_prefault=0)  # fmt: skip
    if buckets:
        e = llm.engine
        e.runner.enable_decode_buckets(8, e.max_model_len, cuda_graphs=False)
    return llm


@pytest.fixture(scope="module")
def llms(tiny_models):
    path = str(tiny_models["llama-q8_0.gguf"].path)
    return make_llm(path, buckets=False), make_llm(path, buckets=True)


def test_bucket_sizes():
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert bucket_sizes(1024)[-1] == 256
    assert bucket_for(3, (1, 2, 4, 8)) == 4
    assert bucket_for(9, (1, 2, 4, 8)) is None


def tokens(llm: LLM, prompts: list[list[int]], cached: list[int] | None = None) -> list[list[int]]:
    """Greedy tokens of `prompts`; each one's prefix-cache hit appended to `cached`."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    if cached is not None:
        cached.extend(o.metrics.num_cached_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def test_bucketed_greedy_equals_plain_batched_and_with_prefix_hits(llms):
    plain, bucketed = llms
    shared = list(range(3, 60))  # past a block: the second round hits the prefix cache
    prompts = [shared + [7, 8], [5, 6, 7], shared + [9], list(range(20, 45))]
    before = bucketed.engine.runner.bucket_steps
    cached: list[int] = []
    for _ in range(2):
        for batch in (prompts[:1], prompts[:3], prompts):  # buckets 1, 4 (one padded row), 4
            assert tokens(bucketed, batch, cached) == tokens(plain, batch)
    assert max(cached) >= 48  # the shared prefix's blocks came from the cache
    assert bucketed.engine.runner.bucket_steps - before >= 6 * 9  # every decode step bucketed
    assert plain.engine.runner.bucket_steps == 0
    bucketed.engine.check_no_leaks()


def test_padded_rows_write_only_the_scratch_block(llms):
    _, llm = llms
    e, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        e.add_request(f"p{i}", [1 + i, 5, 9, 13, 17], params)
    e.step()  # the three prefills, each sampling its first token
    seqs = list(e.scheduler.running)
    assert len(seqs) == 3 and all(s.num_computed_tokens + 1 == s.num_tokens for s in seqs)
    bs = runner.block_size
    # The slots this decode step writes for its three sequences (their next position).
    real = {e.kv.tables(s.seq_id)[0][s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs
            for s in seqs}  # fmt: skip
    data = runner.kv_cache.data  # [layers, planes, blocks, block_size, heads, dim]
    before = data.clone()
    steps = runner.bucket_steps
    e.step()  # three decodes in bucket 4: one padded row
    assert runner.bucket_steps == steps + 1
    changed = (data != before).flatten(start_dim=4).any(-1).any(0).any(0).flatten()  # per slot
    written = set(torch.nonzero(changed).flatten().tolist())
    scratch = set(range(runner.buckets.scratch_block * bs, (runner.buckets.scratch_block + 1) * bs))
    assert real <= written
    assert written - real <= scratch  # the padded row wrote nothing else
    assert scratch.isdisjoint(slot for s in seqs for b in e.kv.tables(s.seq_id)[0]
                              for slot in range(b * bs, (b + 1) * bs))  # fmt: skip
    while e.has_unfinished_requests():
        e.step()
    for i in range(3):
        e.pop_finished(f"p{i}")
    e.check_no_leaks()
