"""What the engine loop sends per step: a streaming request's news every step (or every N tokens
with `stream_interval`), a `stream=False` request's only when it ends — always the same tokens,
text and metrics in the end. A real engine on a tiny model; `emit` records the messages."""

from __future__ import annotations

import time

import pytest

from inferd.config import CacheConfig, EngineConfig
from inferd.engine.core import EngineCore
from inferd.engine.engine_loop import AddRequest, EngineLoop, StepDone
from inferd.sampling.params import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def core(tiny_llama_hf) -> EngineCore:
    config = EngineConfig(model=str(tiny_llama_hf.path), dtype="float32", quantization="none",
                          cache=CacheConfig(kv_cache_memory=4 << 20), log_stats_interval=0)  # fmt: skip
    return EngineCore(config, verbose=False)


def _run(core: EngineCore, stream: bool, interval: int = 1) -> list[StepDone]:
    """One greedy request through a fresh loop; the StepDone messages it sent."""
    sent: list = []
    loop = EngineLoop(core, sent.append, interval)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    commands = [AddRequest("r", [5, 6, 7, 8], params, 0, time.monotonic(), stream)]
    while True:
        loop.iterate(commands)
        commands = []
        if not core.has_unfinished_requests():
            break
    return [m for m in sent if isinstance(m, StepDone)]


def _news(steps: list[StepDone]) -> list[list[int]]:
    return [d.new_token_ids for m in steps for u in m.updates.values() for d in u.deltas]


def test_a_final_only_request_is_sent_once_with_everything(core: EngineCore) -> None:
    streamed = _run(core, stream=True)
    assert [len(ids) for ids in _news(streamed)] == [1] * MAX_TOKENS
    final_only = _run(core, stream=False)
    with_news = [m for m in final_only if m.updates]
    assert len(with_news) == 1 and with_news[0].updates["r"].finished
    (delta,) = with_news[0].updates["r"].deltas
    assert delta.new_token_ids == [t for ids in _news(streamed) for t in ids]
    assert delta.text_delta == "".join(
        d.text_delta for m in streamed for d in m.updates["r"].deltas
    )
    assert len(delta.new_logprobs) == MAX_TOKENS
    # The held steps' metrics are not lost: they ride with the messages that go.
    reports = [m.report for m in final_only if m.report is not None]
    assert sum(r.num_generation_tokens for r in reports) == MAX_TOKENS
    assert sum(len(r.inter_token_latencies) for r in reports) == MAX_TOKENS - 1
    assert sum(len(r.ttfts) for r in reports) == 1 and sum(len(r.finished) for r in reports) == 1


def test_stream_interval_sends_the_first_token_then_groups(core: EngineCore) -> None:
    steps = _run(core, stream=True, interval=5)
    assert [len(ids) for ids in _news(steps)] == [1, 5, 5, 1]
    assert sum(m.report.num_generation_tokens for m in steps if m.report) == MAX_TOKENS


def test_stats_go_out_when_a_request_starts_or_ends_and_otherwise_at_most_every_tenth_second(
    core: EngineCore,
) -> None:
    start = time.monotonic()
    steps = _run(core, stream=True)
    took = time.monotonic() - start
    with_stats = [i for i, m in enumerate(steps) if m.report.stats is not None]
    # The step that scheduled the request and the one that finished it carry a snapshot...
    assert with_stats[0] == 0 and with_stats[-1] == len(steps) - 1
    assert steps[0].report.stats.num_running == 1
    last = steps[-1].report.stats
    assert last.num_running == 0 and last.generation_tokens_total >= MAX_TOKENS
    # ... and between them, at most one every 0.1 s (a tiny model's steps take well under that).
    assert len(with_stats) - 2 <= took / 0.1 + 1
    assert len(with_stats) < len(steps)
    # A snapshot is the engine's state then, never changed afterwards: not even its lists.
    live = core.get_stats()
    frozen = live.snapshot()
    assert frozen == live
    live.spec_draft_tokens_per_position.append(1)
    live.generation_tokens_total += 1
    assert frozen.spec_draft_tokens_per_position == [] and frozen != live
    live.spec_draft_tokens_per_position.pop()
    live.generation_tokens_total -= 1
