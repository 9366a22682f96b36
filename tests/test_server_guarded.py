"""The server's guards, on a real server started with them on: API key (from INFERD_API_KEY), a
waiting-queue limit, a body size limit, and a hostile chat template (refused by the sandbox)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, assert_error, metric

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 4096

# Classic template-injection payloads: each must be stopped by Jinja's sandbox, not executed.
EVIL_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("tpl") / "evil.jinja"
    template.write_text(EVIL_TEMPLATE)
    srv = RemoteServer(
        *SMALL_ENGINE,
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
        "--max-request-bytes",
        str(MAX_BYTES),
        "--chat-template",
        str(template),
        env={"INFERD_API_KEY": KEY},
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def test_startup_log(server: RemoteServer) -> None:
    log = server.log_text()
    assert f"{server.url}/v1" in log and MODEL in log
    assert "float32" in log and "KV cache" in log and "max_model_len 1024" in log
    assert KEY not in log


def test_api_key(server: RemoteServer, http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    err = assert_error(http.post("/v1/completions", json=body), 401)
    assert err["type"] == "authentication_error"
    assert_error(
        http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(http.get("/v1/models", headers={"Authorization": KEY}), 401)  # no "Bearer "
    assert_error(http.post("/tokenize", json={"prompt": "hi"}), 401)
    # Probes and scrapers stay open.
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200
    assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]


def test_body_too_large_is_refused_before_parsing(server: RemoteServer, http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"x" * MAX_BYTES + b'"}'
    err = assert_error(
        http.post(
            "/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"}
        ),
        413,
    )
    assert str(MAX_BYTES) in err["message"]
    # Not valid JSON either: a 413 (not a 400) shows the body was never parsed.
    junk = b"{" * (MAX_BYTES + 1)
    assert_error(http.post("/v1/completions", content=junk, headers=AUTH), 413)

    def chunked():  # no Content-Length: the limit must hold while streaming the body in
        for _ in range(10):
            yield b" " * 1000

    assert_error(http.post("/v1/completions", content=chunked(), headers=AUTH), 413)
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200


def test_chat_template_escape_is_refused(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    err = assert_error(r, 400, "messages")
    assert "sandbox" in err["message"]
    assert "<class" not in err["message"] and "uid=" not in err["message"]


def test_queue_full_is_503(server: RemoteServer, http: httpx.Client) -> None:
    long = {
        "prompt": "Count to a thousand:",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as a_client,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as b_client,
        a_client.stream("POST", "/v1/completions", json=long) as a,
    ):
        assert a.status_code == 200
        # Hold A's line iterator: one dropped after its first line closes the stream, the server
        # aborts A, and B may be admitted before the third request (the test then raced).
        a_lines = a.iter_lines()
        next(line for line in a_lines if line.startswith("data: "))  # A is running
        # max-num-seqs 1: B is accepted (headers come back) but must wait behind A.
        with b_client.stream("POST", "/v1/completions", json=long) as b:
            assert b.status_code == 200
            assert metric(http.get("/metrics").text, "inferd:num_requests_waiting") == 1
            third = http.post(
                "/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}
            )
            err = assert_error(third, 503)
            assert err["code"] == "queue_full" and "--max-queue-len" in err["message"]
            assert metric(http.get("/metrics").text, "inferd:num_requests_waiting") == 1  # B, behind A
    # Both streams were abandoned: once the server has noticed, the engine is free again.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if (
            metric(text, "inferd:num_requests_running")
            == metric(text, "inferd:num_requests_waiting")
            == 0
        ):
            break
        time.sleep(0.05)
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
