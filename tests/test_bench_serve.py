"""`inferd bench serve` against a real `inferd serve`: every request streamed, timed and counted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from test_server_utils import SMALL_ENGINE, RemoteServer, free_port, metric

from inferd.cli import main


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = RemoteServer(*SMALL_ENGINE)
    # One request first: C++ kernels compile on first use (minutes on a loaded machine), which
    # would otherwise land inside the measured TTFTs.
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=900)
    yield srv
    srv.close()


def _prefix_hits(server: RemoteServer) -> float:
    return metric(httpx.get(f"{server.url}/metrics").text, "inferd:prefix_cache_hits_total")


def test_sweep_against_inferd_serve(server: RemoteServer, tmp_path, capsys) -> None:
    hits0 = _prefix_hits(server)
    result_file = tmp_path / "out.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "8",
            "--concurrency", "1,4", "--input-len", "32", "--output-len", "8", "--ignore-eos",
            "--slo-ttft-ms", "600000", "--result-file", str(result_file),
            "--plot-dir", str(tmp_path / "plots")]  # fmt: skip
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert json.loads(result_file.read_text()) == report
    assert [p["concurrency"] for p in report["points"]] == [1, 4]
    for p in report["points"]:
        assert p["completed"] == 8 and p["failed"] == 0, p["errors"]
        assert p["output_tokens_per_request"] == [8] * 8  # ignore_eos: exactly max_tokens
        assert p["prompt_tokens"] >= 8 * 32
        assert p["output_tps"] > 0 and p["total_tps"] > p["output_tps"] and p["requests_per_s"] > 0
        # A 600 s TTFT SLO: every request meets it, however loaded the machine.
        assert p["goodput_rps"] == pytest.approx(p["requests_per_s"])
        assert p["slo_met"] == 8 and p["goodput_share"] == 1.0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = p[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"]
    # Every request its own prompt, across both points: none is served from the prefix cache
    # (re-sending the first point's prompts would measure cache hits, not prefill).
    assert _prefix_hits(server) == hits0


def test_runs_with_another_seed_send_other_prompts(server: RemoteServer, capsys) -> None:
    """`--seed` n and n + 1 share no prompt (per-prompt seeds n + i would overlap all but one)."""
    hits0 = _prefix_hits(server)
    for seed in ("5", "6"):
        argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--seed", seed,
                "--concurrency", "2", "--input-len", "32", "--output-len", "2", "--ignore-eos"]  # fmt: skip
        assert main(argv) == 0
    assert _prefix_hits(server) == hits0
    # The same seed again is the same prompts: now they hit.
    assert main(argv) == 0
    assert _prefix_hits(server) > hits0


def test_goodput_counts_the_requests_that_meet_every_target() -> None:
    """Goodput from known timings: per second and as a share of every request sent; a failed
    request meets nothing, a one-token request is judged on its TTFT alone."""
    import argparse

    from inferd.bench.serve import RequestResult, _summarize

    def done(ttft: float, e2e: float, tokens: int) -> RequestResult:
        return RequestResult(ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=4)

    results = [
        done(0.1, 1.1, 11),  # TPOT 0.1 s: meets both
        done(0.3, 1.3, 11),  # TTFT too late
        done(0.1, 2.1, 11),  # TPOT 0.2 s: too slow
        done(0.1, 0.1, 1),  # one token: no TPOT, TTFT meets
        RequestResult(ok=False, error="HTTP 500"),
    ]
    args = argparse.Namespace(slo_ttft_ms=200.0, slo_tpot_ms=150.0, request_rate=float("inf"))
    p = _summarize(args, 4, results, secs=2.0)
    assert p["slo_met"] == 2 and p["goodput_rps"] == 1.0 and p["goodput_share"] == 2 / 5
    assert p["completed"] == 4 and p["failed"] == 1
    assert p["goodput_rps"] <= p["requests_per_s"]
    none = _summarize(argparse.Namespace(slo_ttft_ms=None, slo_tpot_ms=None,
                                         request_rate=float("inf")), 4, results, secs=2.0)  # fmt: skip
    assert none["slo_met"] is None and none["goodput_rps"] is None and none["goodput_share"] is None


def test_wrong_base_url_is_a_clear_error(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and url in err


def test_sse_payloads_from_awkward_chunks() -> None:
    """The client splits SSE events itself: events cut anywhere by the network, CRLF line
    endings (as some servers send), comment lines, and a last event without its blank line."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from inferd.bench.serve import _sse_data

    pieces = [
        b'data: {"a"',
        b": 1}\r\n\r\n: keep-alive\r\n\r\ndata: ",
        b'{"b": 2}\n',
        b"\ndata: [DO",
        b"NE]",
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:  # each its own write, a pause between: the client reads them apart
            await response.write(piece)
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    async def run() -> list[bytes]:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/") as r,
            ):
                return [data async for data in _sse_data(r.content)]
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
