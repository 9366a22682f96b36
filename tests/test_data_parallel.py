"""`inferd serve --data-parallel-size 2`: two real engine processes behind one real front end, on a
tiny random model — requests spread over the replicas, /metrics per replica and in total, each
engine pinned to its core, conversations kept where their history is cached, a replica killed
mid-run without losing a request that had not streamed, and the flags' bad values refused.

One server for the module; the tests run in file order and the last one kills a replica.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tiny_models import TinySpec, write_gguf

from tests.test_server_utils import RemoteServer, assert_no_leaks, metric, wait_until

NAME = "tiny"
CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="two replicas need two cores")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a long context: long requests stay in flight for seconds."""
    path = tmp_path_factory.mktemp("dp") / "tiny-long.gguf"
    write_gguf(path, TinySpec(max_position=2048))
    return path


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        str(model), "--served-model-name", NAME,
        "--data-parallel-size", "2", "--threads", "1",
        "--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--log-stats-interval", "0",
        "--engine-restart-backoff", "0.2", "--enable-debug-endpoints",
    )  # fmt: skip
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def sample(http: httpx.Client, name: str, **labels: str) -> float:
    return metric(http.get("/metrics").text, f"inferd:{name}", model_name=NAME, **labels)


def engine_processes(server: RemoteServer) -> dict[int, psutil.Process]:
    """The live engine processes by their first core."""
    found = {}
    for c in psutil.Process(server.proc.pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                found[min(c.cpu_affinity())] = c
        except psutil.Error:  # gone meanwhile
            pass
    return found


def complete(http: httpx.Client, results: dict[int, httpx.Response], i: int, **body) -> None:
    results[i] = http.post("/v1/completions", json={"prompt": f"request {i}:", **body})


def test_requests_spread_over_pinned_replicas_with_metrics_each_and_in_total(
    server: RemoteServer, http: httpx.Client
) -> None:
    health = http.get("/health")
    assert health.status_code == 200
    replicas = health.json()["replicas"]
    assert sorted(replicas) == ["0", "1"] and all(r["status"] == "ok" for r in replicas.values())
    # Replica i on cores [i*C/2, (i+1)*C/2), one torch thread each (--threads 1).
    half = len(CPUS) // 2
    procs = engine_processes(server)
    assert sorted(procs) == [CPUS[0], CPUS[half]]
    assert procs[CPUS[0]].cpu_affinity() == CPUS[:half]
    assert procs[CPUS[half]].cpu_affinity() == CPUS[half:]
    assert "replica 0 on core" in server.log_text()

    results: dict[int, httpx.Response] = {}
    body = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=complete, args=(http, results, i), kwargs=body)
               for i in range(6)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results.values()), results
    done = {r: sample(http, "request_success_total", finished_reason="length", replica=r)
            for r in ("0", "1")}  # fmt: skip
    assert done["0"] >= 1 and done["1"] >= 1, done  # least_load: both took some
    assert sample(http, "request_success_total", finished_reason="length") == 6
    tokens = sample(http, "generation_tokens_total")
    assert tokens == 6 * 64
    assert tokens == sum(sample(http, "generation_tokens_total", replica=r) for r in "01")
    blocks = [sample(http, "num_total_kv_blocks", replica=r) for r in "01"]
    assert sample(http, "num_total_kv_blocks") == sum(blocks) > 0
    assert sample(http, "time_to_first_token_seconds_count") == 6
    assert_no_leaks(http)


def test_conversations_return_to_the_replica_that_caches_them(http: httpx.Client) -> None:
    """Three conversations taking turns: each turn's history is served from the prefix cache
    (all its whole blocks), as on one engine, so each turn went where the last one did."""
    topics = ["the sea", "mountains", "a city at night"]
    conversations = [[{"role": "system", "content": f"You are a poet who writes about {t}. "
                       + "Keep every answer short and vivid. " * 12}] for t in topics]  # fmt: skip
    last_prompt = [0] * len(conversations)
    history = cached = 0
    for turn in range(3):
        for c, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Verse {turn} please."})
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                        "temperature": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            if turn:
                history += last_prompt[c] // 16 * 16  # the last turn's whole blocks
                cached += usage["prompt_tokens_details"]["cached_tokens"]
            last_prompt[c] = usage["prompt_tokens"]
            messages.append(r.json()["choices"][0]["message"])
    assert history > 0 and cached >= history, (cached, history)


def test_a_killed_replica_loses_no_request_that_had_not_streamed(
    server: RemoteServer, http: httpx.Client
) -> None:
    """Non-streamed requests on the killed replica move to the other one and finish; a stream
    that had started there ends with an error it can read; the replica is restarted."""
    long = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    results: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=complete, args=(http, results, i), kwargs=long)
               for i in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    wait_until(lambda: all(sample(http, "num_requests_running", replica=r) >= 1 for r in "01"),
               60, "both replicas running")  # fmt: skip
    victim = engine_processes(server)[CPUS[0]]
    with http.stream("POST", "/v1/completions",
                     json={"prompt": "stream", "stream": True, **long}) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        victim.send_signal(signal.SIGKILL)
        # The server stays healthy on the other replica and says which one is down.
        wait_until(lambda: http.get("/health").json()["replicas"]["0"]["status"] != "ok", 30)
        health = http.get("/health")
        assert health.status_code == 200, health.text
        assert health.json()["replicas"]["0"]["status"] == "engine_restarting", health.text
        assert health.json()["replicas"]["1"]["status"] == "ok", health.text
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    for i, res in results.items():
        assert res.status_code == 200, (i, res.text)
        assert res.json()["usage"]["completion_tokens"] == 1500
    assert server.log_text().count("moved to replica 1") >= 1
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])  # it streamed: on the victim it fails, else it finishes
    if "error" in last:
        assert last["error"]["code"] == "engine_dead", last
    else:
        assert last["choices"][0]["finish_reason"] == "length", last
    # The other replica served meanwhile; the dead one comes back.
    wait_until(lambda: http.get("/health").json()["replicas"]["0"]["status"] == "ok", 120,
               "replica 0 restarted")  # fmt: skip
    assert sample(http, "engine_restarts_total", replica="0") == 1
    assert sample(http, "engine_restarts_total", replica="1") == 0
    assert engine_processes(server)[CPUS[0]].pid != victim.pid
    assert_no_leaks(http)


def serve_fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`inferd serve ARGS` exits with status 2 before it loads anything; returns its stderr."""
    from inferd import cli

    assert cli.main(["--log-level", "WARNING", "serve", "--port", "1", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_values_are_refused_with_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = serve_fails(capsys, "--data-parallel-size", "0")
    assert "--data-parallel-size must be >= 1, got 0" in err
    many = str(len(CPUS) + 1)
    err = serve_fails(capsys, "--data-parallel-size", many)
    assert f"--data-parallel-size {many} needs a core per replica" in err
    err = serve_fails(capsys, "--data-parallel-size", "2", "--threads", str(len(CPUS)))
    assert f"more than the {len(CPUS) // 2} core(s) each of the 2 replicas" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is missing
    err = serve_fails(capsys, "--data-parallel-size", "2", "--distributed-executor-backend", "ray")
    assert "needs Ray: pip install 'inferd[ray]'" in err


def test_replicas_route_through_the_routers_policies() -> None:
    """The replica set asks inferd.router's policy, among the serving replicas only (`loads` names
    them): a conversation's next turn returns to the replica holding its history; a replica that
    is not serving is never chosen; a restarted one starts with an empty tree."""
    from inferd.router.policy import make_policy

    policy = make_policy("cache_aware", cache_threshold=0.0)
    for w in ("0", "1"):
        policy.add_worker(w)
    history = list(range(40))
    first = policy.select(history, {"0": 0, "1": 0})
    other = "1" if first == "0" else "0"
    assert policy.select([7] * 40, {"0": 0, "1": 0}) == other  # a new prefix: the smaller tree
    assert policy.select(history + [99] * 20, {"0": 0, "1": 0}) == first
    assert policy.select(history + [99] * 20, {other: 0}) == other  # only the serving ones
    policy.remove_worker(first)  # a dead replica's cache is gone: so is what it was sent
    policy.add_worker(first)
    assert policy.select(history + [99] * 30, {"0": 0, "1": 0}) == other
    rr = make_policy("round_robin")
    for w in ("0", "1"):
        rr.add_worker(w)
    assert [rr.select("x", {"0": 9, "1": 0}) for _ in range(4)] == ["0", "1", "0", "1"]
    with pytest.raises(ValueError, match="nope"):
        make_policy("nope")


def test_totals_sum_the_replicas_and_weigh_the_ratios() -> None:
    from inferd.engine.engine_loop import StepReport
    from inferd.engine.stats import EngineStats
    from inferd.server.metrics import ServerMetrics
    from inferd.server.replica_metrics import render_replicas

    stats = {"0": EngineStats(num_total_blocks=100, kv_cache_usage=0.5, num_running=2),
             "1": EngineStats(num_total_blocks=300, kv_cache_usage=0.1, num_running=1)}  # fmt: skip
    metrics = {r: ServerMetrics("m", lambda s=s: s) for r, s in stats.items()}
    metrics["0"].on_step(StepReport(None, num_generation_tokens=5, ttfts=[0.1]))
    metrics["1"].on_step(StepReport(None, num_generation_tokens=7, ttfts=[0.2, 0.3]))
    text = render_replicas(metrics).decode()

    def value(name: str, **labels: str) -> float:
        return metric(text, f"inferd:{name}", model_name="m", **labels)

    assert value("generation_tokens_total", replica="0") == 5
    assert value("generation_tokens_total", replica="1") == 7
    assert value("generation_tokens_total") == 12
    assert value("num_requests_running") == 3 and value("num_total_kv_blocks") == 400
    assert value("kv_cache_usage_perc") == pytest.approx((50 + 30) / 400)
    assert value("time_to_first_token_seconds_count") == 3
    assert value("time_to_first_token_seconds_bucket", le="0.25") == 2
    for line in text.splitlines():  # each family described once
        if line.startswith("# TYPE"):
            assert text.count(line + "\n") == 1, line
