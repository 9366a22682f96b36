"""`inferd router` in front of two real `inferd serve` workers (a tiny random model, one thread
each): conversations stay where their history is cached, exact mode follows the workers' KV
events, streams pass through, a SIGKILLed worker loses no request that had not started streaming,
and bad input gets OpenAI-shaped errors.

The tests share the workers and run in file order; the last one kills a worker.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import aiohttp
import httpx
import pytest
from test_server_utils import RemoteServer, assert_error, free_port, metric

from inferd.cli import main

WORKER_ARGS = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--block-size", "8",
               "--log-stats-interval", "0", "--max-num-seqs", "2"]  # fmt: skip
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
LONG = 240  # tokens of each stream in the kill test (the workers' context is 256)
ROUTER_ARGS = ["--health-check-interval", "0.5", "--health-failure-threshold", "1"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models):
    return tiny_models["llama-f32.gguf"].path


def _router(urls: list[str], *args: str) -> RemoteServer:
    return RemoteServer("--worker-urls", *urls, *ROUTER_ARGS, *args, command="router")


@pytest.fixture(scope="module")
def cluster(tiny_gguf) -> Iterator[dict]:
    """Two workers, each publishing its KV events, and three routers over them, all started at
    once (a router is healthy once a worker is): {"workers": [(server, events endpoint)],
    "cache_aware": ..., "round_robin": ..., "exact": ...}."""
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    starts = {
        **{f"worker{i}": partial(RemoteServer, str(tiny_gguf), *WORKER_ARGS, "--kv-events-endpoint",
                                 e, port=p, env=ONE_THREAD) for i, (p, e) in enumerate(zip(ports, endpoints))},
        # cache_aware: approximate (no --kv-events), its tokenizer from the workers' /v1/models.
        "cache_aware": partial(_router, urls, "--policy", "cache_aware"),
        "round_robin": partial(_router, urls, "--policy", "round_robin"),
        "exact": partial(_router, urls, "--kv-events", *endpoints, "--tokenizer", str(tiny_gguf)),
    }  # fmt: skip
    with ThreadPoolExecutor(len(starts)) as ex:
        futures = {name: ex.submit(start) for name, start in starts.items()}
        started = {}
        try:
            for name, f in futures.items():
                started[name] = f.result()
        finally:
            if len(started) < len(futures):  # one failed: close what did start
                for f in futures.values():
                    if f.exception() is None:
                        f.result().close()
    yield {
        **started,
        "workers": [(started["worker0"], endpoints[0]), (started["worker1"], endpoints[1])],
    }
    for name in ("cache_aware", "round_robin", "exact", "worker0", "worker1"):
        started[name].close()


@pytest.fixture(scope="module")
def workers(cluster) -> list[tuple[RemoteServer, str]]:
    return cluster["workers"]


@pytest.fixture(scope="module")
def cache_aware(cluster) -> RemoteServer:
    return cluster["cache_aware"]


@pytest.fixture(scope="module")
def round_robin(cluster) -> RemoteServer:
    return cluster["round_robin"]


def _reset_caches(workers) -> None:
    for s, _ in workers:
        assert httpx.post(f"{s.url}/reset_prefix_cache", timeout=60).json() == {"reset": True}


USERS = ["Tell me about the sea and its long tides", "What is a prime number, briefly",
         "List three colours of a sunset sky", "Why do cats purr when they are happy",
         "Describe a quiet mountain village"]  # fmt: skip


def _conversations(url: str, turns: int = 3) -> float:
    """Five conversations, their turns interleaved (turn 1 of each, then turn 2 ...), sent one at
    a time; the share of the later turns' prompt tokens served from the prefix cache."""
    histories: list[list[dict]] = [[] for _ in USERS]
    cached = prompt = 0
    with httpx.Client(base_url=url, timeout=120) as c:
        for turn in range(turns):
            for i, history in enumerate(histories):
                history.append({"role": "user", "content": f"{USERS[i]} (turn {turn})"})
                r = c.post("/v1/chat/completions", json={"messages": history, "max_tokens": 6,
                                                         "temperature": 0})  # fmt: skip
                assert r.status_code == 200, r.text
                body = r.json()
                history.append(
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
                )
                if turn:
                    prompt += body["usage"]["prompt_tokens"]
                    cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached / prompt


def test_cache_aware_keeps_the_cache_hit_share_of_one_engine(
    workers, cache_aware, round_robin
) -> None:
    """Through cache_aware each conversation stays on the worker that holds its history, so the
    later turns hit the cache as they would on one engine; round_robin sends each turn to the
    other worker than the last (five conversations, two workers) and hits only what two turns
    before left there."""
    _reset_caches(workers)
    one_engine = _conversations(workers[0][0].url)
    _reset_caches(workers)
    aware = _conversations(cache_aware.url)
    _reset_caches(workers)
    rr = _conversations(round_robin.url)
    assert one_engine > 0.4, (one_engine, aware, rr)
    assert aware >= 0.95 * one_engine, (one_engine, aware, rr)
    assert rr < 0.8 * one_engine, (one_engine, aware, rr)
    # Both workers served conversations, and the router's estimate saw the hits.
    text = httpx.get(f"{cache_aware.url}/metrics").text
    per_worker = [metric(text, "inferd_router:requests_total", worker=s.url) for s, _ in workers]
    assert min(per_worker) >= 5 and sum(per_worker) == 15, per_worker
    hits = sum(
        metric(text, "inferd_router:routed_prefix_hit_tokens_total", worker=s.url)
        for s, _ in workers
    )
    routed = sum(
        metric(text, "inferd_router:routed_prompt_tokens_total", worker=s.url) for s, _ in workers
    )
    assert 0.3 < hits / routed < 1, (hits, routed)  # the replies it never saw are misses


def _stream(url: str, payload: dict) -> tuple[list[dict], bytes]:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**payload, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]  # fmt: skip
    return events, raw


def test_streams_pass_through_with_usage(workers, round_robin) -> None:
    payload = {"prompt": "One two three four", "max_tokens": 5, "temperature": 0,
               "stream_options": {"include_usage": True}}  # fmt: skip
    direct, _ = _stream(workers[0][0].url, payload)
    via, raw = _stream(round_robin.url, payload)
    assert raw.endswith(b"data: [DONE]\n\n")
    text = lambda evs: "".join(c["text"] for e in evs for c in e["choices"])
    assert text(via) == text(direct)
    assert via[-1]["usage"]["completion_tokens"] == 5 == direct[-1]["usage"]["completion_tokens"]
    assert [e["choices"][0]["finish_reason"] for e in via if e["choices"]][-1] == "length"


def test_exact_mode_routes_a_prefix_to_the_worker_holding_it(workers, cluster) -> None:
    """Worker 2 alone has seen a prompt (sent to it directly, past the router): with its KV
    events the router sends that prompt's continuation there, where an empty tree and equal
    loads would have picked worker 1."""
    router, w2 = cluster["exact"], workers[1][0]
    prompt = "A long shared preamble that only the second worker has computed so far, " * 2
    before = _counter(router, "inferd_router:kv_event_batches_total", worker=w2.url)
    r = httpx.post(
        f"{w2.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while _counter(router, "inferd_router:kv_event_batches_total", worker=w2.url) == before:
        assert time.monotonic() < deadline, "no KV event reached the router"
        time.sleep(0.05)
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt + "and more", "max_tokens": 1},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8
    assert _counter(router, "inferd_router:requests_total", worker=w2.url) == 1
    assert _counter(router, "inferd_router:routed_prefix_hit_tokens_total", worker=w2.url) >= 8
    assert _counter(w2, "inferd:kv_events_dropped_total") == 0  # the worker reports its drops


def _counter(server: RemoteServer, name: str, **labels: str) -> float:
    """A counter's value on /metrics; 0 before its first increment (no sample yet)."""
    try:
        return metric(httpx.get(f"{server.url}/metrics").text, name, **labels)
    except KeyError:
        return 0.0


def test_bad_input_gets_clear_errors(workers, round_robin, capsys) -> None:
    url = round_robin.url
    assert_error(httpx.post(f"{url}/v1/completions", content=b"{not json"), 400)
    assert_error(httpx.post(f"{url}/v1/chat/completions", content=b"[1, 2]"), 400)
    # The worker's own validation passes through as it answered.
    assert_error(
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}),
        400,
        "max_tokens",
    )
    assert_error(httpx.post(f"{url}/workers", json={"url": "ftp://host"}), 400, "url")
    assert_error(httpx.post(f"{url}/workers", json={"url": workers[0][0].url}), 409, "url")
    assert_error(httpx.delete(f"{url}/workers/http://127.0.0.1:1"), 404, "url")
    with pytest.raises(SystemExit) as exit_info:  # argparse's own error, exit status 2
        main(["router", "--worker-urls", "http://a:1", "--policy", "fastest"])
    assert exit_info.value.code == 2 and "invalid choice: 'fastest'" in capsys.readouterr().err
    assert main(["router", "--worker-urls", "localhost:8000"]) == 2
    assert "scheme must be http or https" in capsys.readouterr().err
    assert (
        main(["router", "--worker-urls", "http://a:1", "--kv-events", "tcp://a:1", "tcp://a:2"])
        == 2
    )
    assert "one per worker" in capsys.readouterr().err


def test_workers_can_be_removed_and_added_at_run_time(workers, round_robin) -> None:
    url, w2 = round_robin.url, workers[1][0].url
    removed = httpx.delete(f"{url}/workers/{w2}")
    assert removed.status_code == 200 and removed.json()["url"] == w2
    assert [w["url"] for w in httpx.get(f"{url}/workers").json()["workers"]] == [workers[0][0].url]

    def count() -> float:
        return metric(httpx.get(f"{url}/metrics").text, "inferd_router:requests_total", worker=w2)

    def complete() -> int:
        payload = {"prompt": "hi", "max_tokens": 1}
        return httpx.post(f"{url}/v1/completions", json=payload, timeout=60).status_code

    n = count()
    assert [complete() for _ in range(3)] == [200] * 3
    assert count() == n  # none went to the removed worker
    added = httpx.post(f"{url}/workers", json={"url": w2})
    assert added.status_code == 201 and added.json()["healthy"] is True
    assert [complete() for _ in range(2)] == [200] * 2
    assert count() == n + 1


def test_bench_multi_turn_through_the_router(workers, cache_aware, tiny_gguf, capsys) -> None:
    """`inferd bench serve --scenario multi-turn` runs against any base URL: here the router."""
    _reset_caches(workers)
    argv = ["bench", "serve", "--scenario", "multi-turn", "--base-url", cache_aware.url,
            "--tokenizer", str(tiny_gguf), "--conversations", "3", "--turns", "3",
            "--concurrency", "3", "--input-len", "16", "--output-len", "4", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["completed_requests"] == 9 and report["failed_requests"] == 0
    assert len(report["ttft_ms_p50_per_turn"]) == 3
    # Each later turn's history (all but its new user message) was computed on the same worker.
    assert 0.4 < report["cached_share_later_turns"] < 1, report


def test_a_client_that_leaves_mid_stream_frees_its_worker(workers, round_robin) -> None:
    """The router drops its upstream request when its client goes: the worker aborts the
    request (nothing keeps running for nobody) and the router's load count returns to 0."""
    url = round_robin.url

    def aborted() -> float:
        return sum(
            _counter(s, "inferd:request_success_total", finished_reason="abort") for s, _ in workers
        )

    before = aborted()
    payload = {"prompt": "Count: one two", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # streaming: now leave
    deadline = time.monotonic() + 30
    while True:
        loads = [w["load"] for w in httpx.get(f"{url}/workers").json()["workers"]]
        running = sum(_counter(s, "inferd:num_requests_running") for s, _ in workers)
        if loads == [0, 0] and running == 0:
            break
        assert time.monotonic() < deadline, (loads, running)
        time.sleep(0.05)
    assert aborted() == before + 1  # cut short, not run to its LONG tokens


async def _stream_one(session: aiohttp.ClientSession, url: str, out: dict) -> dict:
    payload = {"prompt": "Count: one two", "max_tokens": LONG, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=payload) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if out["first_byte"] is None:
                out["first_byte"] = time.monotonic()
            if line.startswith(b"data: [DONE]"):
                out["done"] = True
            elif line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                elif event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
    return out


def test_a_killed_worker_loses_no_request_that_had_not_started_streaming(
    workers, round_robin
) -> None:
    """Eight streams at once, four per worker, each worker running two at a time: worker 2 is
    SIGKILLed once streams are flowing. Its queued requests (no byte streamed yet) are retried on
    worker 1 and complete; only streams already flowing from it end early, with an error event."""
    url, victim = round_robin.url, workers[1][0]

    async def run() -> tuple[list[dict], float]:
        results = [
            {"first_byte": None, "done": False, "tokens": 0, "error": None} for _ in range(8)
        ]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks = [asyncio.create_task(_stream_one(session, url, r)) for r in results]
            deadline = time.monotonic() + 120
            # Kill once the victim has its four and streams flow: a stream of LONG tokens takes
            # far longer than this wait, so the victim's two queued requests have not started.
            while time.monotonic() < deadline:
                async with session.get(f"{url}/workers") as resp:
                    loads = {w["url"]: w["load"] for w in (await resp.json())["workers"]}
                if loads.get(victim.url, 0) >= 4 and any(r["first_byte"] for r in results):
                    break
                await asyncio.sleep(0.005)
            victim.proc.send_signal(signal.SIGKILL)  # its engine process exits with it
            killed_at = time.monotonic()
            return list(await asyncio.gather(*tasks)), killed_at

    results, killed_at = asyncio.run(run())
    victim.proc.wait(30)
    # Whether a stream had started is the router's view (a byte forwarded), which the client's
    # clock cannot tell: a byte sent before the kill may be read after it. So: every request
    # completes whole, or ends with worker_failed after bytes had flowed, and at most the two
    # the victim was running end so: its two queued ones were retried and completed.
    cut = [r for r in results if not r["done"]]
    for r in results:
        if r["done"]:
            assert r["tokens"] == LONG and r["error"] is None, r
    assert all(r["first_byte"] is not None and r["error"] and r["error"]["code"] == "worker_failed"
               for r in cut), cut  # fmt: skip
    assert len(cut) <= 2, cut
    assert any(r["first_byte"] < killed_at for r in results)  # the kill came with streams flowing
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "inferd_router:retries_total") >= 1  # its queued requests went elsewhere
    assert metric(text, "inferd_router:worker_healthy", worker=victim.url) == 0
