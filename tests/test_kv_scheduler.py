"""Block pool, block tables and scheduler on their own: exact block ids, budgets, preemption order."""

from __future__ import annotations

import random

import pytest

from inferd.config import SchedulerConfig
from inferd.kv.block_pool import BlockPool, OutOfBlocksError
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.scheduler import Scheduler
from inferd.scheduler.sequence import Sequence, SequenceStatus


def _seq(n_prompt: int, priority: int = 0, arrival: float = 0.0) -> Sequence:
    # Distinct prompts (offset by arrival): identical ones would share a prefix and wait for it.
    first = int(arrival * 1000)
    tokens = list(range(first, first + n_prompt))
    return Sequence("r", 0, tokens, n_prompt, SamplingParams(), priority, arrival)


def test_block_pool_allocate_free_integrity():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    pool.incref([1])
    pool.decref(a)
    assert pool.ref_counts == [0, 1, 0, 0] and pool.num_free == 3
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    pool.check_integrity({1: 1})
    pool.decref([1])
    pool.check_integrity({})
    # Freed blocks are reused first, most recently freed first, in the order they were freed;
    # never-used block 3 waits behind them.
    assert pool.allocate(4) == [1, 0, 2, 3]


def test_allocate_slots_and_slot_mapping():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots(1, 0, 6)  # positions 0..5 → two blocks
    assert kv.block_tables[1] == [0, 1]
    assert [kv.slot(1, p) for p in (0, 3, 4, 5)] == [0, 3, 4, 5]
    assert kv.allocate_slots(1, 6, 2)  # fits in block 1
    assert kv.block_tables[1] == [0, 1]
    assert kv.allocate_slots(1, 8, 1)
    assert kv.block_tables[1] == [0, 1, 2]
    assert not kv.allocate_slots(2, 0, 100)  # too big: nothing changes
    assert kv.pool.num_free == 5
    kv.free(1)
    kv.free(2)
    kv.check_integrity()
    assert kv.pool.num_free == 8


def test_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots(1, 0, 6)  # [0, 1], block 1 half full
    kv.fork(1, 2)
    assert kv.pool.ref_counts[:2] == [2, 2]
    assert kv.allocate_slots(2, 6, 1)  # child writes position 6 into the shared block 1
    assert kv.block_tables[2] == [0, 2] and kv.take_pending_copies() == ([(1, 2)], [])
    assert kv.allocate_slots(1, 6, 1)  # parent is now the only owner of block 1: no copy
    assert kv.block_tables[1] == [0, 1] and kv.take_pending_copies() == ([], [])
    kv.check_integrity()
    kv.free(1)
    kv.free(2)
    assert kv.pool.num_free == 8


def test_scheduler_budget_chunks_and_decodes_first():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), kv)
    a, b = _seq(25, arrival=0), _seq(3, arrival=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s is a, n) for s, n in out.scheduled] == [(True, 10)]  # a's first chunk takes it all
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert [n for _, n in out.scheduled] == [10]
    a.num_computed_tokens += 10
    out = sched.schedule()  # a's last 5 tokens, then b's 3-token prompt fills the budget
    assert [(s is a, n) for s, n in out.scheduled] == [(True, 5), (False, 3)]
    a.num_computed_tokens += 5
    b.num_computed_tokens += 3
    a.token_ids.append(1)
    c = _seq(30, arrival=2)
    sched.add(c)
    out = sched.schedule()
    # decode of a (1 token) first; b has no new token yet so it is not scheduled; c gets the rest
    assert [(s, n) for s, n in out.scheduled] == [(a, 1), (c, 9)]


def test_prefill_chunks_next_to_decodes_are_capped():
    """While decodes run, prefill tokens per step are capped at max(N, decodes): running streams keep
    their pace while a long prompt streams in; with no decodes the whole budget goes to prefill."""
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, prefill_chunk_with_decodes=8), kv)
    decodes = [_seq(3, arrival=i) for i in range(5)]
    for s in decodes:
        sched.add(s)
    assert sum(n for _, n in sched.schedule().scheduled) == 15  # no decodes yet: no cap
    for s in decodes:
        s.num_computed_tokens = 3
        s.token_ids.append(7)
    long_a, long_b = _seq(100, arrival=10), _seq(100, arrival=11)
    sched.add(long_a)
    sched.add(long_b)
    out = sched.schedule()  # 5 decodes; the prefills share max(8, 5) = 8 tokens
    assert [(s in decodes, n) for s, n in out.scheduled] == [(True, 1)] * 5 + [(False, 8)]
    long_a.num_computed_tokens += 8
    for s in decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(7)
    more = [_seq(2, arrival=20 + i) for i in range(10)]
    for s in more:
        sched.add(s)
    for s in more:  # 15 decodes now
        s.num_computed_tokens = 2
        s.token_ids.append(7)
        sched.waiting.remove(s)
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
        kv.allocate_slots(s.seq_id, 0, 3)
    out = sched.schedule()  # the cap grows with the decodes: max(8, 15) = 15 prefill tokens
    assert sum(n for s, n in out.scheduled if s in (long_a, long_b)) == 15
    assert [n for s, n in out.scheduled if s in (long_a, long_b)] == [15]  # long_a first
    # 0 switches the cap off: the budget alone limits prefill.
    kv2 = KVCacheManager(num_blocks=256, block_size=4)
    off = Scheduler(SchedulerConfig(max_num_batched_tokens=512, prefill_chunk_with_decodes=0), kv2)
    d, p = _seq(3, arrival=0), _seq(100, arrival=1)
    off.add(d)
    off.schedule()
    d.num_computed_tokens = 3
    d.token_ids.append(7)
    off.add(p)
    assert [n for _, n in off.schedule().scheduled] == [1, 100]
    with pytest.raises(ValueError, match="prefill-chunk-with-decodes"):
        SchedulerConfig(prefill_chunk_with_decodes=-1)


def test_scheduler_preempts_lowest_priority_and_requeues():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv)
    hi, lo = _seq(8, priority=0, arrival=1), _seq(8, priority=1, arrival=0)
    for s in (hi, lo):
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [hi, lo]  # priority first, arrival second
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        s.token_ids.append(0)
    out = sched.schedule()  # both need a third block, only 0 free: lo is preempted
    assert out.preempted == [lo] and [s for s, _ in out.scheduled] == [hi]
    assert lo.status is SequenceStatus.WAITING and lo.num_computed_tokens == 0
    assert sched.waiting == [lo] and sched.num_preemptions == 1
    kv.check_integrity()


def test_cache_aware_admission_prefers_cached_prefix_with_bounded_wait():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1), kv)
    sched.max_skips = 2
    warm = list(range(100, 112))
    kv.attach_cached_prefix(0, warm)
    kv.allocate_slots(0, 0, 12)
    kv.cache_computed_blocks(0, warm, 12)
    kv.free(0)  # warm's 3 blocks stay in the cache
    cold = _seq(12, arrival=0.0)
    hot = [Sequence("h", 0, warm + [i], 13, SamplingParams(), 0, 1.0 + i) for i in range(3)]
    sched.add(cold)
    for h in hot:
        sched.add(h)
    admitted = []
    for _ in range(4):
        out = sched.schedule()
        (seq, n), = out.scheduled
        admitted.append(seq)
        sched.finish(seq)
    # Cache hits jump the queue, but the cold head goes after being passed over twice.
    assert admitted == [hot[0], hot[1], cold, hot[2]]
    assert hot[0].num_computed_tokens == 12  # served from the cache
    kv.check_integrity()


def test_cache_aware_admission_sees_tree_changes_between_steps():
    # Cached-prefix lengths of waiting requests are looked up once per change of the tree: a
    # prefix cached, or flushed, after a request was first looked at must change the choice.
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1), kv)
    warm = list(range(100, 112))

    def admit() -> Sequence:
        ((seq, _),) = sched.schedule().scheduled
        sched.finish(seq)
        return seq

    hot = [Sequence("h", 0, warm + [i], 13, SamplingParams(), 0, 1.0 + i) for i in range(2)]
    cold = [_seq(12, arrival=a) for a in (0.5, 0.7)]
    for s in (cold[0], *hot):
        sched.add(s)
    assert admit() is cold[0]  # nothing cached: first come, first served
    # Another request computes `warm`: its 3 blocks stay in the cache.
    kv.attach_cached_prefix(999, warm)
    kv.allocate_slots(999, 0, 12)
    kv.cache_computed_blocks(999, warm, 12)
    kv.free(999)
    sched.add(cold[1])
    assert admit() is hot[0] and hot[0].num_computed_tokens == 12  # the new cache hit jumps the queue
    assert kv.reset_prefix_cache()
    assert admit() is cold[1]  # flushed: hot[1] has no cached prefix any more, the head goes
    assert admit() is hot[1] and hot[1].num_computed_tokens == 0
    kv.check_integrity()


def _in_flight_by_definition(kv: KVCacheManager, seq: Sequence, running: list[Sequence]) -> bool:
    """The rule spelled out block by block: a running prompt still prefilling shares more leading
    full blocks with `seq` (within both prompts, leaving seq's last token) than the cache holds."""
    bs = kv.block_size
    cached = kv.cached_prefix_len(seq.token_ids) // bs
    limit = (seq.num_tokens - 1) // bs
    for other in running:
        if other.num_computed_tokens >= other.num_prompt_tokens:
            continue
        shared, top = 0, min(limit, other.num_prompt_tokens // bs)
        while shared < top and seq.token_ids[shared * bs : (shared + 1) * bs] == other.token_ids[shared * bs : (shared + 1) * bs]:
            shared += 1
        if shared > cached:
            return True
    return False


def test_prefix_in_flight_agrees_with_block_by_block_definition():
    rng = random.Random(0)
    bs = 4
    stem = [rng.randrange(1000) for _ in range(40)]
    checked = {True: 0, False: 0}
    for trial in range(300):
        kv = KVCacheManager(num_blocks=512, block_size=bs)
        sched = Scheduler(SchedulerConfig(), kv)

        def prompt() -> list[int]:  # a random share of the stem, then tokens of its own
            keep = rng.randrange(len(stem) + 1)
            toks = stem[:keep] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 10))]
            if keep and rng.random() < 0.3:  # the stem with one token changed: parts, then agrees
                toks[rng.randrange(keep)] = 5000
            return toks

        cached = stem[: rng.randrange(len(stem) + 1)] + [7]
        kv.attach_cached_prefix(10_000, cached)
        kv.allocate_slots(10_000, 0, len(cached))
        kv.cache_computed_blocks(10_000, cached, len(cached))
        kv.free(10_000)
        running = []
        for i in range(rng.randrange(1, 5)):
            toks = prompt()
            s = Sequence("r", 0, toks, len(toks), SamplingParams())
            s.num_computed_tokens = rng.randrange(len(toks) + 1)  # some still prefilling
            running.append(s)
        prefilling = [s for s in running if s.num_computed_tokens < s.num_prompt_tokens]
        for _ in range(4):
            toks = prompt()
            seq = Sequence("w", 0, toks, len(toks), SamplingParams())
            expected = _in_flight_by_definition(kv, seq, running)
            assert sched._prefix_in_flight(seq, prefilling) is expected, (trial, toks)
            checked[expected] += 1
    assert min(checked.values()) > 50  # both answers were exercised
