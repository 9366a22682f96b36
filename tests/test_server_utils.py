"""Helpers for the server tests: run the real `inferd serve` in a subprocess on a free port.

(No tests here; the name keeps it among the server's files.)
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

# Small KV pool and context: the tests never need more, and two servers may run at once.
SMALL_ENGINE = [
    "--kv-cache-memory",
    "256MiB",
    "--max-model-len",
    "1024",
    "--log-stats-interval",
    "0",
]
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m inferd.cli COMMAND ARGS` (`serve`, or `router`) on 127.0.0.1; waits for /health
    to say 200."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0,
        command: str = "serve", port: int | None = None,
    ) -> None:  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 — open for the server's lifetime
            "w+", prefix="inferd-serve-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "inferd.cli", command, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.health_statuses: list[int] = []
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.HTTPError:
                status = None
            if status is not None:
                self.health_statuses.append(status)
                if status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def server_fixtures(*server_args: str):
    """Module-scoped fixtures `server` (a `RemoteServer` started with `server_args`), `client`
    (the OpenAI client on it) and `http` (an httpx client on it), for a test module to bind:
    `server, client, http = server_fixtures(...)`."""

    @pytest.fixture(scope="module")
    def server():
        srv = RemoteServer(*server_args)
        yield srv
        srv.close()

    @pytest.fixture(scope="module")
    def client(server: RemoteServer) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                             timeout=300)  # fmt: skip

    @pytest.fixture(scope="module")
    def http(server: RemoteServer):
        with httpx.Client(base_url=server.url, timeout=300) as c:
            yield c

    return server, client, http


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"no sample {name} {labels} in /metrics")


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    """The response is an OpenAI error of this status (and `param`, unless "any")."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def wait_until(check, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.05)


def assert_no_leaks(http: httpx.Client) -> None:
    """Once the engine (every replica's) is idle, every KV block is back (the debug endpoint's
    integrity check)."""
    deadline = time.monotonic() + 60
    while (r := http.post("/debug/check_no_leaks")).status_code == 409:
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] and body["num_free_blocks"] == body["num_total_blocks"], body
