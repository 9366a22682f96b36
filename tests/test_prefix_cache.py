"""Radix prefix cache: exact block reuse and eviction order on its own, then inside the engine:
outputs identical with the cache on and off, shared prefixes computed once, eviction safety."""

from __future__ import annotations

import random

import pytest

from inferd import LLM, SamplingParams
from inferd.kv.block_pool import BlockPool
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.layers import attention

BS = 4


def _seq_blocks(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> list[int]:
    """Admit a sequence the way the scheduler does and compute all of it."""
    cached = kv.attach_cached_prefix(seq_id, tokens)
    assert kv.allocate_slots(seq_id, cached, len(tokens) - cached)
    kv.cache_computed_blocks(seq_id, tokens, len(tokens))
    return kv.block_tables[seq_id]


def test_salted_prefixes_are_kept_apart():
    """A cache salt (a tenant's) leads the first block's key: blocks are shared only under the
    same salt, and each salt's prefix is stored once."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = list(range(10))
    for seq_id, salt in ((1, None), (2, "t1")):
        assert kv.attach_cached_prefix(seq_id, a, salt) == 0
        assert kv.allocate_slots(seq_id, 0, len(a))
        kv.cache_computed_blocks(seq_id, a, len(a), salt)
    assert kv.prefix_cache.num_nodes == 4  # two full blocks under each salt
    assert kv.cached_prefix_len(a, "t2") == 0
    assert kv.attach_cached_prefix(3, a, "t1") == 8
    assert kv.block_tables[3] == kv.block_tables[2][:2] != kv.block_tables[1][:2]
    for seq_id in (1, 2, 3):
        kv.free(seq_id)
    kv.check_integrity()
    assert kv.reset_prefix_cache() and kv.pool.num_free == 16


def test_longest_prefix_reuse_exact_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = list(range(10))  # blocks [0..3] [4..7] + partial [8, 9]
    ta = _seq_blocks(kv, 1, a)
    assert ta == [0, 1, 2] and kv.prefix_cache.num_nodes == 2  # the partial block is not cached
    b = a[:6] + [99, 98, 97, 96, 95]  # shares one full block, diverges inside the second
    assert kv.attach_cached_prefix(2, b) == 4
    assert kv.block_tables[2] == [0] and kv.pool.ref_counts[0] == 3  # tree + seq 1 + seq 2
    c = a[:8]  # the whole sequence is cached, but its last token must still be computed
    assert kv.attach_cached_prefix(3, c) == 4
    kv.free(2)
    kv.free(3)
    kv.free(1)
    kv.check_integrity()
    assert kv.pool.num_free == 16 - 2 and kv.pool.num_available == 16  # two blocks cache-only
    assert kv.pool.usage() == 0.0


def test_concurrent_duplicate_prefix_is_stored_once():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(9))
    t1 = _seq_blocks(kv, 1, tokens)
    # Seq 2 was admitted before seq 1 cached anything, so it computed its own copy.
    kv.block_tables[2] = []
    kv.allocate_slots(2, 0, 9)
    own = list(kv.block_tables[2])
    kv.cache_computed_blocks(2, tokens, 9)
    assert kv.block_tables[2][:2] == t1[:2] and kv.block_tables[2][2] == own[2]
    assert kv.pool.ref_counts[own[0]] == 0 and kv.pool.ref_counts[own[1]] == 0  # copies freed
    kv.check_integrity()


def test_eviction_lru_leaves_first_and_never_in_use():
    pool = BlockPool(8)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    pool = kv.pool
    _seq_blocks(kv, 1, [1] * 8 + [0])  # blocks 0, 1 cached (+ partial 2)
    _seq_blocks(kv, 2, [2] * 8 + [0])  # blocks 3, 4 cached (+ partial 5)
    kv.free(1)
    kv.free(2)
    kv.attach_cached_prefix(3, [1] * 8 + [7])  # touch seq 1's prefix: now most recent, in use
    assert kv.block_tables[3] == [0, 1]
    assert kv.prefix_cache.evict(1) == 1
    assert pool.ref_counts[4] == 0 and pool.ref_counts[3] == 1  # seq 2's leaf went first
    assert kv.prefix_cache.evict(10) == 1  # then its parent; blocks 0 and 1 are in use
    assert sorted(kv.prefix_cache.blocks()) == [0, 1]
    kv.free(3)
    assert kv.reset_prefix_cache() and kv.pool.num_free == 8
    kv.check_integrity()


def test_allocation_evicts_cache_only_blocks_on_demand():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _seq_blocks(kv, 1, list(range(12)))  # 3 blocks, 2 cached after... all 3 full → all cached
    kv.free(1)
    assert kv.pool.num_free == 1 and kv.pool.num_available == 4
    assert kv.allocate_slots(2, 0, 16)  # needs all 4: the cache gives its blocks back
    assert kv.prefix_cache.num_nodes == 0
    kv.free(2)
    kv.check_integrity()


# ---- inside the engine, tiny random model ---------------------------------------------------
def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(70)]
    other = [rng.randrange(3, vocab) for _ in range(70)]
    return [
        base[:50],  # the shared prefix ...
        base[:50] + [5, 6, 7],  # ... extended
        base[:33] + other[:20],  # partial share, diverging inside a block
        base[:64],  # exactly four full blocks
        other[:41],  # nothing shared
        base[:50],  # identical to the first
    ]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama-hf"]


def _run(llm: LLM, prompts, sequential: bool, max_tokens: int = 12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if sequential:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("kv_blocks", [64, 12])  # 12 blocks of 16: eviction and preemption
def test_greedy_identical_with_cache_on_and_off(tiny, sequential, kv_blocks):
    per_block = 16 * 2 * tiny.spec.layers * tiny.spec.kv_heads * tiny.spec.head_dim * 4
    kw = dict(kv_cache_memory=kv_blocks * per_block, max_model_len=128, verbose=False)
    prompts = _prompts(tiny.vocab_size, seed=kv_blocks)
    off = LLM(str(tiny.path), enable_prefix_caching=False, **kw)
    on = LLM(str(tiny.path), enable_prefix_caching=True, **kw)
    expected, _ = _run(off, prompts, sequential)
    got, outs = _run(on, prompts, sequential)
    got2, outs2 = _run(on, prompts, sequential)  # second pass: served from cache where it fits
    assert got == expected and got2 == expected
    if kv_blocks == 64:
        # Each prompt's full blocks, capped so its last token is computed: (len - 1) // 16 blocks.
        assert [o.metrics.num_cached_tokens for o in outs2] == [48, 48, 48, 48, 32, 48]
        assert on.get_stats().prefix_cache_hits_total > 0
    off.engine.check_no_leaks()
    on.engine.check_no_leaks()


def test_shared_prefix_of_16_concurrent_requests_is_computed_once(tiny):
    llm = LLM(str(tiny.path), kv_cache_memory=8 << 20, verbose=False, max_num_batched_tokens=256)
    rng = random.Random(1)
    prefix = [rng.randrange(3, tiny.vocab_size) for _ in range(96)]
    prompts = [prefix + [rng.randrange(3, tiny.vocab_size) for _ in range(8)] for _ in range(16)]
    # The first request computes the prefix; the others arrive while it is still running.
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.get_stats().prompt_tokens_total
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # fmt: skip
    computed = llm.get_stats().prompt_tokens_total - before
    assert computed == 15 * 8  # only the distinct suffixes
    assert all(o.metrics.num_cached_tokens == 96 for o in outs)
    llm.engine.check_no_leaks()


def test_concurrent_first_requests_share_prefix_while_running(tiny):
    # All 16 arrive together: the first admitted computes the prefix in its prefill step; the
    # cache-aware scheduler then admits the rest, which hit it (the step budget lets one prefill
    # of 104 tokens through at a time).
    llm = LLM(str(tiny.path), kv_cache_memory=8 << 20, verbose=False, max_num_batched_tokens=110)
    rng = random.Random(2)
    prefix = [rng.randrange(3, tiny.vocab_size) for _ in range(96)]
    prompts = [prefix + [rng.randrange(3, tiny.vocab_size) for _ in range(8)] for _ in range(16)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # fmt: skip
    computed = llm.get_stats().prompt_tokens_total
    assert computed <= 1.1 * (96 + 16 * 8)
    assert sum(o.metrics.num_cached_tokens == 96 for o in outs) == 15
    llm.engine.check_no_leaks()


def _torch_attention(llm: LLM) -> LLM:
    """`llm` on the torch attention backend: the one that batches short queries into a padded
    group, and so runs cascade attention (the CPU backend sends every query to its paged kernel)."""
    runner = llm.engine.runner
    runner.model.select_kernels(runner.device, runner.dtype, attention="torch")
    runner.attention_kernel = None
    return llm


def _cascade_calls(monkeypatch) -> list[int]:
    """Count the steps' cascade attention calls (the real function still runs)."""
    calls: list[int] = []
    real = attention._cascade_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_cascade_attention", counted)
    return calls


# Suffix lengths short enough for the padded group, most too long for the C++ kernel, ending
# mid-block and on block boundaries.
_SUFFIX_LENGTHS = [32, 5, 16, 17, 31, 9, 1, 24, 13, 32, 7, 20, 15, 3, 28, 11]


def test_cascade_attention_greedy_identical_to_cache_off(tiny, monkeypatch):
    # 150 shared tokens: 9 full blocks the 16 suffixes attend to through cascade attention.
    rng = random.Random(4)
    prefix = [rng.randrange(3, tiny.vocab_size) for _ in range(150)]
    prompts = [prefix + [rng.randrange(3, tiny.vocab_size) for _ in range(n)]
               for n in _SUFFIX_LENGTHS]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = _torch_attention(LLM(str(tiny.path), enable_prefix_caching=False,
                               kv_cache_memory=8 << 20, verbose=False))  # fmt: skip
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    on = _torch_attention(LLM(str(tiny.path), kv_cache_memory=8 << 20, verbose=False))
    on.generate([prefix + [5]], SamplingParams(max_tokens=1), use_tqdm=False)  # the prefix is hot
    calls = _cascade_calls(monkeypatch)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert calls  # the suffixes did go through cascade attention
    on.engine.check_no_leaks()


def test_cascade_attention_real_model_greedy_identical_to_cache_off(monkeypatch):
    from inferd.bench.prompts import synthetic_prompt
    from tests.real_model import loaded_default, make_llm

    tok = loaded_default().tokenizer
    prefix = synthetic_prompt(tok, 300, seed=5)
    prompts = [prefix + synthetic_prompt(tok, n, seed=50 + i)
               for i, n in enumerate(_SUFFIX_LENGTHS)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    off = _torch_attention(make_llm(enable_prefix_caching=False))
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    on = _torch_attention(make_llm())
    on.generate([prefix + [5]], SamplingParams(max_tokens=1), use_tqdm=False)
    calls = _cascade_calls(monkeypatch)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert got == expected and calls
    on.engine.check_no_leaks()


def test_running_blocks_survive_eviction_pressure(tiny):
    per_block = 16 * 2 * tiny.spec.layers * tiny.spec.kv_heads * tiny.spec.head_dim * 4
    llm = LLM(str(tiny.path), kv_cache_memory=10 * per_block, max_model_len=128, verbose=False)
    engine = llm.engine
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, tiny.vocab_size) for _ in range(60)]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    held = list(engine.kv.block_tables[engine.requests["long"].seqs[0].seq_id])
    # Fill the cache with other prompts while "long" decodes: eviction must spare its blocks.
    for i in range(6):
        other = [rng.randrange(3, tiny.vocab_size) for _ in range(33)]
        engine.add_request(f"o{i}", other, SamplingParams(max_tokens=2))
        for _ in range(3):
            engine.step()
            seq = engine.requests["long"].seqs[0]
            if not seq.is_finished and seq.num_preemptions == 0:
                assert engine.kv.block_tables[seq.seq_id][: len(held)] == held
        engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    for rid in list(engine.requests):
        engine.pop_finished(rid)
    engine.check_no_leaks()


def test_flush_returns_every_block(tiny):
    llm = LLM(str(tiny.path), kv_cache_memory=4 << 20, verbose=False)
    llm.generate([{"prompt_token_ids": list(range(3, 70))}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.engine.kv.prefix_cache.num_nodes > 0
    assert llm.reset_prefix_cache()
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks and llm.engine.kv.prefix_cache.num_nodes == 0
