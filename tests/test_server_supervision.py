"""`inferd serve` keeps serving through a dying or stalled engine, a client that stops reading,
and requests that outlive their `timeout` — the real server, the real engine process, real
signals (SIGKILL, SIGSTOP), no mocks.

One server for the module, with short supervision flags; the tests run in file order and the
last ones leave its engine dead on purpose.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.test_server_utils import (
    MODEL,
    RemoteServer,
    assert_error,
    assert_no_leaks,
    metric,
    wait_until,
)

ARGS = [
    "--engine-process",
    "--kv-cache-memory", "256MiB",
    "--max-model-len", "4096",
    "--log-stats-interval", "0",
    "--engine-restart-backoff", "0.2",
    "--max-engine-restarts", "1",
    "--engine-heartbeat-timeout", "0.5",
    "--max-stream-buffer-tokens", "64",
    "--enable-debug-endpoints",
    "--disable-log-requests",
]  # fmt: skip
LONG = {"prompt": "Count: 1, 2,", "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = RemoteServer(*ARGS)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def engine_process(server: RemoteServer) -> psutil.Process:
    """The live engine process (a killed one may linger a moment as a zombie)."""
    children = []
    for c in psutil.Process(server.proc.pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                children.append(c)
        except psutil.Error:  # gone, or a zombie, meanwhile
            pass
    assert len(children) == 1, children
    return children[0]


def counter(http: httpx.Client, name: str, **labels: str) -> float:
    return metric(http.get("/metrics").text, f"inferd:{name}", model_name=MODEL, **labels)


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_a_timeout_aborts_the_request_and_frees_it(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "timeout": 0}), 400, "timeout")
    before = counter(http, "request_success_total", finished_reason="abort")
    start = time.monotonic()
    err = assert_error(http.post("/v1/completions", json={**LONG, "timeout": 0.5}), 408, "timeout")
    assert err["code"] == "request_timeout" and "0.5 s" in err["message"]
    assert time.monotonic() - start < 30  # aborted, not run to its 3000 tokens
    with http.stream("POST", "/v1/completions", json={**LONG, "timeout": 0.5, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    # A request that ends in time is not touched by its timeout.
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "timeout": 60})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert counter(http, "request_timeouts_total") == 2
    wait_until(
        lambda: counter(http, "request_success_total", finished_reason="abort") == before + 2
    )
    assert_no_leaks(http)


def test_a_client_that_stops_reading_is_dropped_and_its_request_freed(
    server: RemoteServer, http: httpx.Client
) -> None:
    before = counter(http, "request_success_total", finished_reason="abort")
    # n and logprobs: many bytes per step, so the socket's buffers fill within a few dozen steps.
    body = {**LONG, "max_tokens": 1000, "n": 4, "logprobs": 5, "stream": True}
    body = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that stops at once
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    try:
        wait_until(lambda: counter(http, "stream_overflows_total") == 1, 240, "the overflow")
        wait_until(lambda: counter(http, "request_success_total", finished_reason="abort")
                   == before + 1, 30, "the abort")  # fmt: skip
        # The server hung up: reading what is left ends (reset, or EOF), and never in [DONE].
        sock.settimeout(30)
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
        assert b"data: [DONE]" not in received
    finally:
        sock.close()
    assert_no_leaks(http)
    assert "too slowly" in server.log_text()


def test_one_long_step_is_busy_not_stalled(server: RemoteServer, http: httpx.Client) -> None:
    """A ~1,800-token prompt in one step outlasts --engine-heartbeat-timeout 0.5 on every CPU
    here (a second or more of prefill with no news): the engine is computing, so /health stays
    200."""
    words = " ".join(f"w{i % 97}" for i in range(620))  # ~3 tokens a word
    statuses: list[int] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as probe:
            while not done.is_set():
                statuses.append(probe.get("/health").status_code)
                time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        r = http.post("/v1/completions", json={"prompt": words, "max_tokens": 1})
    finally:
        done.set()
        watcher.join()
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 1500
    assert took > 1.0, f"the prompt took {took:.1f} s: no step outlasted the heartbeat"
    assert statuses and set(statuses) == {200}, statuses
    assert "busy, not stalled" in server.log_text()
    assert "no progress" not in server.log_text()
    assert_no_leaks(http)


def test_a_stalled_engine_turns_health_503_until_it_moves_again(
    server: RemoteServer, http: httpx.Client
) -> None:
    engine = engine_process(server)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        engine.send_signal(signal.SIGSTOP)
        try:
            # --engine-heartbeat-timeout 0.5: within a few seconds of the last step.
            wait_until(lambda: http.get("/health").status_code == 503, 30, "engine_stalled")
            err = assert_error(http.get("/health"), 503)
            assert err["code"] == "engine_stalled" and "no progress" in err["message"]
        finally:
            engine.send_signal(signal.SIGCONT)
        wait_until(lambda: http.get("/health").status_code == 200, 30, "healthy again")
        assert next(line for line in lines if line.startswith("data: {"))  # it streams on
    assert_no_leaks(http)


def test_a_killed_engine_is_restarted(server: RemoteServer, http: httpx.Client) -> None:
    old = engine_process(server)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        old.send_signal(signal.SIGKILL)
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "killed by SIGKILL" in error["message"], error
    assert error["type"] == "server_error"
    # Meanwhile (backoff, then the new engine loads): 503 engine_restarting, or healthy again.
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    if r.status_code != 200:
        assert assert_error(r, 503)["code"] == "engine_restarting"
    wait_until(lambda: http.get("/health").status_code == 200, 120, "the restarted engine")
    assert engine_process(server).pid != old.pid
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert counter(http, "engine_restarts_total") == 1
    assert_no_leaks(http)


def test_past_the_restart_limit_the_engine_stays_dead(
    server: RemoteServer, http: httpx.Client
) -> None:
    """Last: --max-engine-restarts 1 is used up, so this leaves the server without an engine."""
    engine_process(server).send_signal(signal.SIGKILL)
    wait_until(lambda: http.get("/health").status_code == 503, 30, "the death")
    time.sleep(1.0)  # past the backoff: no restart comes
    err = assert_error(http.get("/health"), 503)
    assert err["code"] == "engine_dead" and "--max-engine-restarts 1" in err["message"], err
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
    assert err["code"] == "engine_dead" and "restart the server" in err["message"]
    assert counter(http, "engine_restarts_total") == 1
    assert server.proc.poll() is None  # the server itself is still up to say so
