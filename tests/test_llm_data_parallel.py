"""`LLM(model, data_parallel_size=2)`: two engine replicas in processes of their own (one core
each). Greedy outputs equal one engine's, in prompt order, every request finished, both replicas
used; a repeated batch goes back to the replicas that cached it (the same prefix-cache hits as one
engine); an invalid prompt fails the call before anything runs and the replicas serve on; close()
and dropping the LLM end the replica processes."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch
from tiny_models import TinySpec, write_gguf

from inferd import LLM, SamplingParams
from tests.test_server_utils import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"verbose": False, "kv_cache_memory": 8 << 20, "max_model_len": 256,
          "enable_prefix_caching": True}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("llm-dp") / "tiny.gguf", TinySpec()).path


def prompts() -> list[str | list[int]]:
    """Text and token-id prompts of different lengths, no two sharing a first block."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (40, 23, 57, 33)]
    return ["the quick brown fox jumps", *ids, "over the lazy dog, twice"]


def run_twice(llm: LLM) -> tuple[list, list, int]:
    first = llm.generate(prompts(), GREEDY, use_tqdm=False)
    second = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return first, second, llm.get_stats().prefix_cache_hits_total


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_two_replicas_answer_as_one_engine(model: Path) -> None:
    with LLM(str(model), **ENGINE) as one:
        one_first, one_second, one_hits = run_twice(one)
    with LLM(str(model), data_parallel_size=2, **ENGINE) as llm:
        pids = llm.replicas.pids
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        first, second, hits = run_twice(llm)
        per_replica = llm.replicas.replica_stats()
    assert gone(pids)
    for outs, ref in ((first, one_first), (second, one_second)):
        assert [o.prompt for o in outs] == [o.prompt for o in ref]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(s.requests_finished_total >= 1 for s in per_replica), per_replica
    assert sum(s.requests_finished_total for s in per_replica) == 2 * len(prompts())
    # Each prompt went back to the replica that cached it the first time.
    assert hits == one_hits > 0


def test_an_invalid_prompt_fails_before_anything_runs(model: Path) -> None:
    with LLM(str(model), data_parallel_size=2, **ENGINE) as llm:
        bad = [*prompts(), list(range(3, 300))]  # longer than max_model_len
        with pytest.raises(ValueError, match=f"prompt {len(bad) - 1}"):
            llm.generate(bad, GREEDY, use_tqdm=False)
        assert llm.get_stats().requests_finished_total == 0
        out = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert len(out) == len(prompts())
        assert llm.reset_prefix_cache()


def test_dropping_the_llm_ends_its_replicas(model: Path) -> None:
    llm = LLM(str(model), data_parallel_size=2, **ENGINE)
    pids = llm.replicas.pids
    del llm
    gc.collect()
    wait_until(lambda: gone(pids), 60, "the replicas to exit")


def test_bad_sizes_are_value_errors(model: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(str(model), data_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="needs a core per replica"):
        LLM(str(model), data_parallel_size=64, **ENGINE)
