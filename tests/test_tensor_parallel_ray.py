"""Tensor parallelism on Ray (`--distributed-executor-backend ray`): worker ranks as Ray actors, one
placement group bundle per rank, on a real local Ray started here. Greedy tokens equal the mp
backend's and one engine's (fp32 and packed Q8_0 blocks); closing or dropping the engine leaves no
rank actor and no placement group behind; `serve --data-parallel-size 2 --tensor-parallel-size 2`
runs each replica's ranks in the replica's own placement group and answers as one engine does.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tiny_models import TinySpec, write_gguf, write_hf_dir

from inferd import LLM, SamplingParams
from tests.test_server_utils import RemoteServer, metric, wait_until
from tests.test_tensor_parallel import HEADS_8X8, _generate, one_thread  # noqa: F401 (autouse)

ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group_table  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray for this module (4 logical CPUs: two replicas of two ranks); its address."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-ray")


def actor_processes(name: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if name in " ".join(p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def assert_nothing_left() -> None:
    """No rank actor's process runs and every placement group is removed."""
    wait_until(lambda: not actor_processes("RankActor"), 60, "the rank actors to exit")
    states = {g["state"] for g in placement_group_table().values()}
    assert states <= {"REMOVED"}, placement_group_table()


CASES = {
    "4q2kv-fp32": ("hf", TinySpec(), "none"),
    "8q8kv-q8_0": ("q8_0", HEADS_8X8, "auto"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_on_ray_equals_mp_and_one_engine(cluster, root, case):
    fmt, spec, quantization = CASES[case]
    if fmt == "hf":
        path = write_hf_dir(root / case, spec).path
    else:
        path = write_gguf(root / f"{case}.gguf", spec, quant=fmt).path
    on_ray = _generate(path, 2, quantization=quantization, distributed_executor_backend="ray")
    assert_nothing_left()
    assert on_ray == _generate(path, 2, quantization=quantization)
    assert on_ray == _generate(path, 1, quantization=quantization)


def test_a_dropped_engine_takes_its_actors_along(cluster, root):
    path = write_hf_dir(root / "dropped", TinySpec()).path
    llm = LLM(str(path), verbose=False, kv_cache_memory=8 << 20, tensor_parallel_size=2,
              distributed_executor_backend="ray")  # fmt: skip
    assert len(actor_processes("RankActor")) == 1
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    del llm
    gc.collect()
    assert_nothing_left()


def test_too_many_ranks_for_the_cluster_is_a_value_error(cluster, root):
    path = write_hf_dir(root / "big", HEADS_8X8).path
    with pytest.raises(ValueError, match="the Ray cluster has 4"):
        LLM(str(path), verbose=False, kv_cache_memory=8 << 20, tensor_parallel_size=8,
            distributed_executor_backend="ray")  # fmt: skip
    assert_nothing_left()


PROMPTS = [f"request {i}: the quick brown fox" for i in range(4)]


def test_serve_dp2_tp2_on_ray(cluster, root):
    """Two replicas, each rank 0 an engine actor with its rank 1 in the replica's placement
    group: answers equal one engine's, both replicas serve, nothing is left at shut-down."""
    path = write_gguf(root / "serve.gguf", TinySpec()).path
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), verbose=False, kv_cache_memory=8 << 20) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    srv = RemoteServer(str(path), "--served-model-name", "tiny", "--kv-cache-memory", "8MiB",
                       "--max-model-len", "256", "--log-stats-interval", "0",
                       "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                       "--distributed-executor-backend", "ray", "--ray-address", cluster)  # fmt: skip
    try:
        health = httpx.get(f"{srv.url}/health").json()
        assert {r["status"] for r in health["replicas"].values()} == {"ok"}
        assert "1 tensor-parallel rank actor" in health["replicas"]["0"]["placement"]
        assert len(actor_processes("RankActor")) == 2
        results: dict[int, str] = {}

        def one(i: int) -> None:
            body = {"prompt": PROMPTS[i], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)
            results[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(PROMPTS))] == expected
        text = httpx.get(f"{srv.url}/metrics").text
        per_replica = [metric(text, "inferd:request_success_total", model_name="tiny",
                              finished_reason="length", replica=r) for r in "01"]  # fmt: skip
        assert min(per_replica) >= 1 and sum(per_replica) == len(PROMPTS), per_replica
    finally:
        srv.close()
    wait_until(lambda: not actor_processes("EngineActor"), 60, "the engine actors to exit")
    assert_nothing_left()
