"""The latency-aware step budget: prefill tokens next to decodes capped by a per-token cost model,
uncapped without decodes, uncapped for a prompt whose TTFT target is at risk; the learnt model;
and the invariant that capping changes chunking, never outputs."""

from __future__ import annotations

import math

import pytest

from inferd.config import SchedulerConfig
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.scheduler import Scheduler
from inferd.scheduler.sequence import Sequence
from inferd.scheduler.step_cost import FixedStepCost, LearnedStepCost, StepShape

# A step costs 20 ms + 1 ms per decode row + 0.5 ms per prefill token (no attention term): 4
# decodes alone cost 24 ms; at factor 1.5 a step may add 12 ms, i.e. 24 prefill tokens.
COST = FixedStepCost(fixed=0.020, per_decode=0.001, per_prefill=0.0005)


def _seq(n_prompt: int, arrival: float) -> Sequence:
    first = int(arrival * 1000)  # distinct prompts: no shared prefix to wait for
    return Sequence("r", 0, list(range(first, first + n_prompt)), n_prompt, SamplingParams(),
                    0, arrival)  # fmt: skip


def _scheduler(cost=COST, clock=None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks=256, block_size=4)
    config = {"max_num_batched_tokens": 512, "prefill_chunk_with_decodes": 0, **config}
    return Scheduler(SchedulerConfig(**config), kv, cost=cost, clock=clock)


def _decoding(sched: Scheduler, n: int) -> list[Sequence]:
    """`n` sequences admitted, prefilled and waiting for their next decode."""
    seqs = [_seq(3, arrival=i) for i in range(n)]
    for s in seqs:
        sched.add(s)
    assert [k for _, k in sched.schedule().scheduled] == [3] * n
    for s in seqs:
        s.num_computed_tokens = 3
        s.token_ids.append(7)
    return seqs


def _prefills(out, decodes) -> list[int]:
    return [n for s, n in out.scheduled if s not in decodes]


def test_prefill_next_to_decodes_is_capped_by_the_cost_model() -> None:
    sched = _scheduler()
    decodes = _decoding(sched, 4)
    long_a, long_b = _seq(100, arrival=10), _seq(100, arrival=11)
    sched.add(long_a)
    sched.add(long_b)
    out = sched.schedule()
    assert [n for s, n in out.scheduled if s in decodes] == [1] * 4
    assert _prefills(out, decodes) == [24]  # the room is spent: long_b waits
    assert sched.budget.num_capped_steps == 1
    # The prefill in flight keeps its pace next step (decodes first, then its next 24 tokens).
    long_a.num_computed_tokens += 24
    for s in decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(7)
    assert _prefills(sched.schedule(), decodes) == [24]
    # A larger factor makes more room: (3 - 1) * 24 ms / 0.5 ms = 96 tokens.
    wide = _scheduler(max_step_latency_factor=3.0)
    decodes = _decoding(wide, 4)
    wide.add(_seq(100, arrival=10))
    assert _prefills(wide.schedule(), decodes) == [96]


def test_attention_term_prices_late_chunks_higher() -> None:
    # 1 ms per 1024 query-key pairs: the same room buys fewer tokens deep into a long prompt.
    cost = FixedStepCost(fixed=0.020, per_decode=0.001, per_prefill=0.0005, per_attention=0.001)
    sched = _scheduler(cost=cost)
    decodes = _decoding(sched, 4)
    long = _seq(400, arrival=10)
    sched.add(long)
    first = _prefills(sched.schedule(), decodes)
    long.num_computed_tokens = 300
    for s in decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(7)
    later = _prefills(sched.schedule(), decodes)
    assert first[0] > later[0] >= 4
    for n, start in ((first[0], 0), (later[0], 300)):  # each the most that fits the room
        room = 0.5 * cost.seconds(StepShape(4, 0, 0.0))
        assert (
            cost.prefill_seconds(start, n)
            <= room + 1e-12
            < cost.prefill_seconds(start, n + 1) + 1e-9
        )


def test_without_decodes_a_prompt_takes_the_full_chunk() -> None:
    sched = _scheduler()
    long = _seq(100, arrival=0)
    sched.add(long)
    assert [n for _, n in sched.schedule().scheduled] == [100]
    assert sched.budget.num_capped_steps == 0


def test_prefill_is_never_starved() -> None:
    # Prefill so dear that no token fits the room: the step still takes one block of the prompt.
    sched = _scheduler(cost=FixedStepCost(fixed=0.020, per_decode=0.001, per_prefill=1.0))
    decodes = _decoding(sched, 4)
    sched.add(_seq(100, arrival=10))
    sched.add(_seq(100, arrival=11))
    assert _prefills(sched.schedule(), decodes) == [4]  # block_size 4, for the first prompt only


def test_a_prompt_whose_ttft_target_is_at_risk_takes_its_chunk() -> None:
    now = [10.0]
    sched = _scheduler(clock=lambda: now[0], ttft_slo_ms=1000)
    decodes = _decoding(sched, 4)
    long = _seq(100, arrival=10.0)
    sched.add(long)
    # Fresh: 100 tokens at 24 per 36 ms step arrive in ~0.18 s, well inside 1 s: capped.
    assert _prefills(sched.schedule(), decodes) == [24]
    long.num_computed_tokens = 24
    for s in decodes:
        s.num_computed_tokens += 1
        s.token_ids.append(7)
    now[0] = 10.9  # waited 0.9 s: 76 tokens more at the capped pace would miss the target
    assert _prefills(sched.schedule(), decodes) == [76]
    assert sched.budget.num_slo_rescues == 1


def test_an_unfitted_model_caps_nothing_and_inf_switches_the_cap_off() -> None:
    for sched in (_scheduler(cost=LearnedStepCost()), _scheduler(max_step_latency_factor=math.inf)):
        decodes = _decoding(sched, 4)
        sched.add(_seq(100, arrival=10))
        assert _prefills(sched.schedule(), decodes) == [100]
    with pytest.raises(ValueError, match="max-step-latency-factor"):
        SchedulerConfig(max_step_latency_factor=0.5)
    with pytest.raises(ValueError, match="ttft-slo-ms"):
        SchedulerConfig(ttft_slo_ms=0)


def test_learned_cost_recovers_the_coefficients_and_skips_outliers() -> None:
    true = (0.004, 0.0008, 0.0006, 0.0002)
    model = LearnedStepCost(min_samples=16)
    shapes = [
        StepShape(d, p, a)
        for d in (1, 4, 8, 16, 32)
        for p in (0, 16, 128)
        for a in (0.0, 2048.0, 8192.0)
    ]
    assert model.coefficients() is None
    for shape in shapes * 2:
        model.record(shape, sum(c * x for c, x in zip(true, shape.features())))
    assert model.coefficients() == pytest.approx(true, rel=1e-4)
    model.record(StepShape(8, 0, 0.0), 1.0)  # a step that lost the CPU: left out
    assert model.num_outliers == 1
    assert model.coefficients() == pytest.approx(true, rel=1e-4)
    model.record(shapes[0], sum(c * x for c, x in zip(true, shapes[0].features())))  # ends the run
    # A machine that stays 4x slower is not an outlier: after a run of them the model follows.
    for shape in shapes * 8:
        model.record(shape, 4 * sum(c * x for c, x in zip(true, shape.features())))
    assert model.num_outliers <= 1 + 2 * model.max_outliers  # a run or two of them, then none
    assert model.coefficients() == pytest.approx([4 * c for c in true], rel=0.05)
    # Never a negative price, whatever the data: a token that "saves" time would be free to add.
    noisy = LearnedStepCost(min_samples=4)
    for d, p, y in ((1, 0, 0.010), (2, 0, 0.009), (1, 64, 0.012), (2, 64, 0.008), (4, 0, 0.007)):
        noisy.record(StepShape(d, p, 0.0), y)
    assert min(noisy.coefficients()) >= 0.0


# ---- the real engine ------------------------------------------------------------------------


def _run_arrivals(engine, tag: str) -> list[list[int]]:
    """One stream decoding while two long prompts arrive, on the default model, greedy: every
    request's tokens."""
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = ["The quick brown fox", "Once upon a time, in a land far away, " * 6,
             "Write a short poem about the sea and the sky and the wind, " * 5]  # fmt: skip
    engine.add_request(tag + "a", texts[0], params)
    decoded = engine.scheduler.num_generation_tokens
    while engine.scheduler.num_generation_tokens < decoded + 2:  # "a" decodes when the others come
        engine.step()
    for rid, text in zip("bc", texts[1:]):
        assert len(tok.encode(text)) > 40  # several blocks: chunked when capped
        engine.add_request(tag + rid, text, params)
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_finished(tag + rid).outputs[0].token_ids for rid in "abc"]


def test_capping_changes_chunking_never_outputs() -> None:
    import torch

    from tests.real_model import make_llm

    # One thread: two OpenMP threads on a machine shared with other jobs can spin for seconds
    # per step (outputs are the same for any thread count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _same_outputs_capped_and_not(make_llm)
    finally:
        torch.set_num_threads(threads)


def _same_outputs_capped_and_not(make_llm) -> None:
    # No prefix cache: the second run computes every prompt afresh, as the first did.
    engine = make_llm(enable_prefix_caching=False).engine
    budget = engine.scheduler.budget
    # Prefill priced so high that each step next to a decode takes one block (16 tokens) only.
    budget.cost = FixedStepCost(fixed=0.005, per_decode=0.001, per_prefill=1.0)
    capped = _run_arrivals(engine, "capped-")
    num_capped = budget.num_capped_steps
    budget.factor = math.inf  # the same engine, uncapped: whole prompts next to the decode
    uncapped = _run_arrivals(engine, "uncapped-")
    assert num_capped > 0 and budget.num_capped_steps == num_capped
    assert capped == uncapped
    assert all(len(t) == 8 for t in capped)
