"""`inferd serve --data-parallel-size 2 --distributed-executor-backend ray`: two engine replicas as
Ray actors (one placement group each) on a real local Ray cluster started here, behind one real
front end — requests routed to both, greedy outputs equal to the mp backend's, and an actor that
dies is replaced.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tiny_models import TinySpec, write_gguf

from tests.test_server_utils import RemoteServer, metric

ray = pytest.importorskip("ray")

NAME = "tiny"
PROMPTS = [f"request {i}: the quick brown fox" for i in range(6)]
ENGINE = ["--served-model-name", NAME, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
          "--log-stats-interval", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "tiny.gguf"
    write_gguf(path, TinySpec())
    return path


@pytest.fixture(scope="module")
def mp_server(model: Path) -> Iterator[RemoteServer]:
    """The mp backend's server, started while Ray starts (the first thing that waits for it)."""
    box: dict[str, RemoteServer | BaseException] = {}

    def start() -> None:
        try:
            box["server"] = RemoteServer(str(model), *ENGINE)
        except BaseException as e:  # noqa: BLE001 — raised below, in the test's thread
            box["server"] = e

    thread = threading.Thread(target=start)
    thread.start()
    yield box  # type: ignore[misc]
    thread.join()
    if isinstance(srv := box["server"], RemoteServer):
        srv.close()


@pytest.fixture(scope="module")
def cluster(mp_server) -> Iterator[str]:
    """A local Ray for this module; yields its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def complete_all(url: str) -> list[dict]:
    """Every prompt at once (greedy), as the server answers them, in prompt order."""
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        results[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def mp_outputs(mp_server, cluster: str) -> list[str]:
    deadline = time.monotonic() + 600
    while "server" not in mp_server:
        assert time.monotonic() < deadline, "the mp server never started"
        time.sleep(0.1)
    srv = mp_server["server"]
    if isinstance(srv, BaseException):
        raise srv
    try:
        return [r["choices"][0]["text"] for r in complete_all(srv.url)]
    finally:
        srv.close()  # idle from here on: its memory back for the Ray replicas


@pytest.fixture(scope="module")
def server(model: Path, cluster: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(str(model), *ENGINE, "--data-parallel-size", "2",
                       "--distributed-executor-backend", "ray", "--ray-address", cluster,
                       "--engine-restart-backoff", "0.2")  # fmt: skip
    yield srv
    srv.close()


def sample(url: str, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, f"inferd:{name}", model_name=NAME, **labels)


def test_replicas_on_ray_answer_as_the_mp_backend(
    server: RemoteServer, mp_outputs: list[str]
) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert {r["status"] for r in health["replicas"].values()} == {"ok"}
    assert "Ray actor with 1 CPU" in health["replicas"]["0"]["placement"]
    outputs = complete_all(server.url)
    assert [r["choices"][0]["text"] for r in outputs] == mp_outputs
    per_replica = [sample(server.url, "request_success_total", finished_reason="length",
                          replica=r) for r in "01"]  # fmt: skip
    assert min(per_replica) >= 1 and sum(per_replica) == len(PROMPTS), per_replica


def actor_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "EngineActor" in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    return found


def all_ok(server: RemoteServer) -> bool:
    replicas = httpx.get(f"{server.url}/health").json().get("replicas", {})
    return len(replicas) == 2 and all(r["status"] == "ok" for r in replicas.values())


def test_a_dead_actor_is_replaced(server: RemoteServer) -> None:
    victims = actor_processes()
    assert len(victims) == 2, victims
    victims[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 180
    while sum(sample(server.url, "engine_restarts_total", replica=r) for r in "01") < 1:
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.2)
    while not all_ok(server) or len(actor_processes()) != 2:
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.2)
    assert "Ray actor died" in server.log_text()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200
