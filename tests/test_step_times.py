"""F re-measured from the engine's own steps (inferd.spec.step_times): plain steps paired with
their neighbouring verifications replace the noisy start-up calibration once there are enough,
and the plain reference steps the policy asks for keep greedy outputs what they are."""

from __future__ import annotations

import pytest
from tiny_models import TinySpec, write_gguf

from inferd import LLM, SamplingParams
from inferd.spec import decoder as spec_decoder
from inferd.scheduler.sequence import Sequence
from inferd.spec import step_times
from inferd.spec.policy import SpecPolicy
from inferd.spec.step_times import StepTimes


def test_neighbouring_steps_give_the_cost_of_their_rows() -> None:
    times = StepTimes()
    times.record(1, 0, 0.020)
    for seconds in (0.022, 0.021, 0.022, 0.022):  # 3 rows, plain, 3 rows, plain...
        times.record(1, 3, seconds)
        assert times.extra_cost(1, 3) is None  # each plain step pairs with both neighbours: < 8
        times.record(1, 0, 0.020)
    assert times.extra_cost(1, 3) == pytest.approx(0.10)  # the median of 1.10 x 6 and 1.05 x 2
    assert times.extra_cost(1, 2) is None and times.extra_cost(2, 3) is None


def test_pairs_need_one_plain_step_at_the_same_batch_size() -> None:
    times = StepTimes()
    for _ in range(10):
        times.record(1, 2, 0.03)  # verifications only: nothing to compare with
        times.record(1, 3, 0.03)
    assert times.extra_cost(1, 2) is None and times.extra_cost(1, 3) is None
    for _ in range(10):
        times.record(2, 0, 0.02)
        times.record(1, 2, 0.04)  # another batch size's neighbour
        times.record(1, None, 0.02)  # a prefill step in between breaks the pair
    assert times.extra_cost(1, 2) is None and times.extra_cost(2, 2) is None
    for _ in range(10):
        times.record(step_times.MAX_BATCH + 1, 0, 0.02)
        times.record(step_times.MAX_BATCH + 1, 1, 0.04)
    assert times.extra_cost(step_times.MAX_BATCH + 1, 1) is None  # large batches keep the calibration


def test_the_policy_asks_for_plain_steps_while_speculating() -> None:
    times = StepTimes(reference_every=4)
    for _ in range(3):
        times.record(1, 3, 0.02)
    assert not times.wants_reference(1)
    times.record(1, 3, 0.02)
    assert times.wants_reference(1) and not times.wants_reference(2)
    times.record(1, 0, 0.02)
    assert not times.wants_reference(1)
    policy = SpecPolicy(3, None, {1: [0.0, 0.05, 0.1]})
    policy.step_times = times
    seqs = [Sequence("r", 0, [1, 2], 2, SamplingParams(max_tokens=100))]
    for _ in range(4):
        times.record(1, 3, 0.02)
    assert policy.depths(seqs, batch_size=1) == [0]  # the reference step
    times.record(1, 0, 0.02)
    assert policy.depths(seqs, batch_size=1) == [3]


def test_measured_costs_replace_a_mismeasured_calibration() -> None:
    """A start-up calibration that caught a slow moment (F(2) = F(3) = 0.4, ten times the truth)
    trims a ranked chain to one row; the steps' own times put it back at three."""
    policy = SpecPolicy(3, None, {1: [0.0, 0.4, 0.4]}, ranked=True)
    values = [0.6, 0.15, 0.1]
    assert policy.verified_rows(values, batch_size=1) == 1
    for rows in (1, 2, 3) * 6:
        policy.record_forward(1, 0, 0.0200)
        policy.record_forward(1, rows, 0.0200 * (1.0 + 0.02 * rows))
    assert policy.forward_cost(1, 3) == pytest.approx(0.06)
    assert policy.forward_cost(4, 3) == pytest.approx(0.4)  # not measured there: the calibration
    assert policy.verified_rows(values, batch_size=1) == 3


class _RecordingPolicy(SpecPolicy):
    """The engine's policy with speculation's own time fixed (a tiny model's drafting would price
    it out) and a plain reference step every 4 steps; it keeps the forwards it was told of."""

    forwards: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_times = StepTimes(reference_every=4)

    def record_speculation_time(self, *args) -> None:
        pass

    def record_forward(self, batch_size, extra_rows, seconds) -> None:
        _RecordingPolicy.forwards.append((batch_size, extra_rows))
        super().record_forward(batch_size, extra_rows, seconds)


def test_engine_times_its_steps_and_outputs_do_not_change(tmp_path, monkeypatch) -> None:
    tiny = write_gguf(tmp_path / "tiny.gguf", TinySpec())
    monkeypatch.setattr(spec_decoder, "measure_verify_cost", lambda *args, **kwargs: ({1: 0.02, 64: 0.5}, {}))
    monkeypatch.setattr(spec_decoder, "SpecPolicy", _RecordingPolicy)
    _RecordingPolicy.forwards = []
    prompt = list(range(5, 25)) * 3  # repeats: prompt lookup finds drafts
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", verbose=False, kv_cache_memory=1 << 20)
    off = LLM(str(tiny.path), **kw).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny.path), speculative_config=spec, **kw)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    seen = _RecordingPolicy.forwards
    assert seen[0] == (1, None)  # the prompt
    assert (1, 0) in seen and any(rows and rows > 0 for _, rows in seen)
    policy = llm.engine.spec_policy
    measured = [j for j in range(1, 4) if policy.step_times.extra_cost(1, j) is not None]
    assert measured, seen
    llm.engine.check_no_leaks()
