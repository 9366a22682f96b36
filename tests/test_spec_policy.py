"""The speculation policy: how deep each sequence drafts, from its acceptance and what verifying
drafts costs (`SpecPolicy`, built directly with known costs)."""

from __future__ import annotations

import pytest

from inferd import SamplingParams
from inferd.scheduler.sequence import Sequence
from inferd.spec.policy import FixedDepthPolicy, SpecPolicy, best_depth, expected_tokens, probe_interval


def test_policy_depth_follows_acceptance_and_cost():
    assert expected_tokens(0.0, 3) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert best_depth(0.9, 5, 0.0) == 5  # verification free, drafts good: go deep
    assert best_depth(0.9, 5, 1.0) == 0  # each draft costs a whole step: never pays
    assert 0 < best_depth(0.6, 5, 0.1) < 5
    policy = SpecPolicy(4, disable_by_batch_size=8, verify_cost={1: 0.02, 16: 0.5})
    seqs = [Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100)) for _ in range(3)]
    assert policy.depths(seqs, batch_size=9) == [0, 0, 0]  # the flag's limit
    assert policy.depths(seqs, batch_size=1) == [4, 4, 4]
    assert policy.beta(8) == pytest.approx(0.02 + (0.5 - 0.02) * 7 / 15)
    for _ in range(6):  # a sequence whose drafts keep failing speculates less
        policy.record(seqs[0], 4, 0)
    assert policy.depths(seqs[:1], batch_size=1)[0] < 4
    short = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=2))
    fresh_policy = SpecPolicy(4, disable_by_batch_size=8, verify_cost={1: 0.02, 16: 0.5})
    assert fresh_policy.depths([short], batch_size=1) == [1]  # never more than max_tokens allows


def test_fixed_depth_drafts_k_whatever_the_outcomes():
    """`adaptive_depth: false`: k every step however the drafts fare, every ranked node and (greedy)
    leaf verified; the batch-size limit and max_tokens still hold."""
    policy = FixedDepthPolicy(4, disable_by_batch_size=8, leaf_width=2, ranked=True)
    greedy = Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0, max_tokens=100))
    sampled = Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=1.0, max_tokens=100))
    short = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=3))
    for _ in range(20):
        policy.record(greedy, 4, 0)
    assert policy.depths([greedy, sampled, short], batch_size=3) == [4, 4, 2]
    assert policy.depths([greedy], batch_size=9) == [0]
    assert policy.verified_rows([0.9, 0.1, 0.01], batch_size=1) == 3
    assert policy.leaf_widths([greedy, sampled, greedy], [4, 4, 0], batch_size=3) == [2, 0, 0]


def test_policy_starts_new_sequences_at_what_recent_drafts_were_worth():
    policy = SpecPolicy(3, disable_by_batch_size=None, verify_cost={1: 0.5})
    first = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))
    assert policy.depths([first], batch_size=1) == [1]  # no evidence yet: the prior (a = 0.7)
    for _ in range(20):  # other sequences' drafts keep failing (chat at a large batch)
        policy.record(first, 1, 0)
    late = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))
    assert policy.depths([late], batch_size=1) == [0]  # waits for a probe instead of verifying
    cheap = SpecPolicy(3, disable_by_batch_size=None, verify_cost={1: 0.1})
    for _ in range(20):
        cheap.record(first, 1, 0)
    other = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))
    assert cheap.depths([other], batch_size=1)[0] > 0  # drafts nearly free: it tries at the prior
    for _ in range(60):  # now they are all accepted (a passage being rewritten)
        policy.record(first, 3, 3)
    later = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))
    assert policy.depths([later], batch_size=1) == [3]


def test_policy_prices_each_depth_as_measured():
    """Verification's forward cost by depth (not a price per draft), and speculation's own time
    (drafting, the verification's bookkeeping) as a fixed part plus a part per depth, fitted
    from what it took at each depth."""
    flat = SpecPolicy(3, None, {1: [0.05, 0.10, 0.15]})
    steep = SpecPolicy(3, None, {1: [0.02, 0.10, 0.60]})  # a third draft row costs far more
    assert flat.forward_cost(1, 2) == pytest.approx(0.10)
    assert steep.forward_cost(1, 3) == pytest.approx(0.60)
    seq = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))
    assert flat.depths([seq], batch_size=1) == [3]  # a = 0.7: deeper pays while rows are cheap
    assert steep.depths([seq], batch_size=1) == [2]
    assert SpecPolicy(3, None, {1: 0.05}).forward_cost(1, 3) == pytest.approx(0.15)  # per draft
    # Speculation's own time: nothing measured, free; one depth, proportional; several, a line
    assert flat.speculation_cost(3) == 0.0
    flat.record_speculation_time(0.08, 2, 1.0)  # (0.02 fixed + 0.03 per depth, not yet known)
    assert flat.speculation_cost(1) == pytest.approx(0.04)
    assert flat.speculation_cost(3) == pytest.approx(0.12)
    for depth in (1, 3, 1, 3):
        flat.record_speculation_time(0.02 + 0.03 * depth, depth, 1.0)
    assert flat.speculation_cost(1) == pytest.approx(0.05)
    assert flat.speculation_cost(3) == pytest.approx(0.11)
    assert flat.cost(1, 3) == pytest.approx(1 + 0.15 + 0.11)
    # A fixed part makes going deeper relatively cheaper: at a = 0.5, depth 3 beats depth 1.
    assert best_depth(0.5, 3, lambda k: 1.0 + 0.3 * (k > 0) + 0.01 * k) == 3
    assert best_depth(0.5, 3, 0.1) == 2  # the same first draft's price charged per draft


def test_policy_recovers_from_one_slow_speculation_step():
    """One slow step's own time at depth 3 (three steps' worth: a first call's set-up, a page-fault
    storm) prices every depth out. The sequence still probes one draft now and then, since only
    the part measured online says so, and once that slow point is stale beside the probes' own
    the line leaves it out: the sequence drafts at k_max again (before, it stayed at k = 0)."""
    policy = SpecPolicy(3, None, {1: [0.02, 0.04, 0.06]}, ranked=True)
    seq = Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0.0, max_tokens=100_000))
    policy.depths([seq], batch_size=1)
    policy.record_speculation_time(3.0, 3, 1.0)
    ks = []
    for _ in range(400):
        k = policy.depths([seq], batch_size=1)[0]
        ks.append(k)
        if k:  # half of the drafts accepted, speculation's own time 0.03 of a step per depth
            policy.record(seq, k, (k + 1) // 2)
            policy.record_speculation_time(0.03 * k, k, 1.0)
    first = ks.index(3)
    assert set(ks[:first]) == {0, 1} and 0 < ks[:first].count(1) <= 5  # rare probes at depth 1
    assert first <= 300 and set(ks[first:]) == {3}
    # Where the start-up F itself says a draft costs a step or more, nothing probes.
    dear = SpecPolicy(3, None, {1: [1.2, 2.4, 3.6]}, ranked=True)
    assert not any(dear.depths([seq], batch_size=1)[0] for _ in range(300))


def test_policy_shrinks_a_sequence_s_few_verifications_towards_the_others():
    policy = SpecPolicy(3, disable_by_batch_size=None, verify_cost={1: 0.1})
    others = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=1000))
    policy.depths([others], batch_size=1)
    for _ in range(40):  # everyone else's drafts are mostly accepted
        policy.record(others, 3, 3)
    unlucky = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=1000))
    policy.depths([unlucky], batch_size=1)
    for _ in range(2):  # its own first two verifications failed
        policy.record(unlucky, 3, 0)
    assert unlucky.spec.policy_state.acceptance < 0.3
    assert policy.acceptance(unlucky.spec.policy_state) > 0.5
    assert policy.depths([unlucky], batch_size=1) == [3]
    for _ in range(20):  # a long run of failures outweighs the others
        policy.record(unlucky, 3, 0)
    assert policy.depths([unlucky], batch_size=1)[0] < 3


def test_ranked_sequences_draft_deep_and_verify_what_their_confidence_pays_for():
    """Where the proposer ranks a greedy sequence's nodes, the policy drafts k_max whenever any
    depth pays, and picks the rows from the nodes' own values: the costs below (a dear third row
    beside a cheap first, as a noisy start-up measurement gives) and an acceptance of 0.3 put a
    chain at k = 1, which nothing would then re-measure."""
    costs = {1: [0.03, 0.17, 0.17]}
    ranked = SpecPolicy(3, None, costs, ranked=True)
    chains = SpecPolicy(3, None, costs)
    greedy = [Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0, max_tokens=100)) for _ in range(2)]
    sampled = Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0.8, max_tokens=100))
    for policy in (ranked, chains):
        policy.depths(greedy + [sampled], batch_size=1)
        for seq in greedy + [sampled]:
            for i in range(30):
                policy.record(seq, 1, int(i % 3 == 0))  # a third of the drafts accepted
    assert chains.depths(greedy, batch_size=1) == [1, 1]
    assert ranked.depths(greedy + [sampled], batch_size=1) == [3, 3, 1]  # sampled: chains
    # The rows: a sure head verifies its three nodes, an unsure one its first; never none.
    assert ranked.verified_rows([0.9, 0.6, 0.4], batch_size=1) == 3
    assert ranked.verified_rows([0.3, 0.05, 0.02], batch_size=1) == 1
    ranked.trim_margin = 0.0  # fewer rows chosen only when they do 5 % better
    assert ranked.verified_rows([0.6, 0.1, 0.07], batch_size=1) == 1
    ranked.trim_margin = 0.05
    assert ranked.verified_rows([0.6, 0.1, 0.07], batch_size=1) == 3
    assert ranked.verified_rows([0.001, 0.0005, 0.0001], batch_size=1) == 1
    assert ranked.verified_rows([], batch_size=1) == 0
    # c: accepted tokens per unit of predicted value, across sequences. A head that claims twice
    # what it gets has its values halved, and then verifies fewer rows.
    assert ranked.calibration == pytest.approx(1.0)
    values = [0.6, 0.1, 0.05]
    assert ranked.verified_rows(values, batch_size=1) == 3
    for _ in range(200):
        ranked.record(greedy[0], 3, 1, expected=2.0)
    assert ranked.calibration == pytest.approx(0.5, abs=0.01)
    assert ranked.verified_rows(values, batch_size=1) == 1


def test_policy_probes_less_as_verification_costs_more():
    assert probe_interval(0.0) == 8 and probe_interval(0.7) == 27 and probe_interval(1.0) == 0
    # A large batch probes at most once every 4 steps in all: each sequence far less often.
    assert probe_interval(0.6, batch_size=32) == 128 and probe_interval(0.6, batch_size=2) == 20
    # A sequence whose drafts failed sits at k = 0 and probes one draft every probe_interval steps.
    for cost, every in ((0.1, 9), (0.7, 27), (1.2, 0)):
        policy = SpecPolicy(4, disable_by_batch_size=None, verify_cost={1: cost})
        seq = Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=1000))
        policy.depths([seq], batch_size=1)  # its state starts at the prior
        seq.spec.policy_state.steps_off = 0
        for _ in range(10):
            policy.record(seq, 4, 0)
        ks = [policy.depths([seq], batch_size=1)[0] for _ in range(60)]
        probes = [i + 1 for i, k in enumerate(ks) if k]
        assert probes == list(range(every, 61, every)) if every else probes == [], (cost, probes)
