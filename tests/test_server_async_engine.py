"""AsyncEngine on the real model, in process: streaming, refusals, aborts, a failing step; and the
app served by uvicorn in a thread while the model loads (503) and when a step blows up (readable
errors, the server keeps serving).

The failing step is real fault injection (an `EngineCore` whose `step()` raises once when told to),
not a mock: everything else is the real engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from inferd.config import CacheConfig, EngineConfig, SchedulerConfig
from inferd.engine.async_engine import AsyncEngine, EngineStepError, RequestUpdate
from inferd.engine.core import EngineCore, RequestError
from inferd.sampling.params import SamplingParams
from inferd.server.app import build_app
from tests.real_model import loaded_default
from tests.test_server_utils import assert_error, free_port

CONFIG = EngineConfig(
    cache=CacheConfig(kv_cache_memory=64 << 20),
    scheduler=SchedulerConfig(max_model_len=512),
    log_stats_interval=0,
)


class FlakyEngine(EngineCore):
    """The real engine, whose next step raises when `fail_next` is set (then it heals)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_next = threading.Event()

    def step(self):
        if self.fail_next.is_set():
            self.fail_next.clear()
            raise RuntimeError("injected fault")
        return super().step()


def make_engine() -> FlakyEngine:
    return FlakyEngine(CONFIG, loaded=loaded_default(), verbose=False)


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def collect(engine: AsyncEngine, rid: str, prompt, params) -> tuple[str, list[RequestUpdate]]:
    updates = [u async for u in engine.generate(rid, prompt, params)]
    return "".join(d.text_delta for u in updates for d in u.deltas), updates


async def started(engine: AsyncEngine) -> AsyncEngine:
    engine.start()
    await engine.wait_ready()
    return engine


def test_generate_refuse_abort_and_no_leaks() -> None:
    async def main() -> None:
        engine = await started(AsyncEngine(make_engine))
        try:
            # Streams equal the engine's own synchronous result.
            text, updates = await collect(engine, "a", "Hello, my name is", greedy())
            final = updates[-1].output
            assert final is not None and final.outputs[0].text == text
            assert (
                final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 6
            )
            # Several at once, and a refusal in the middle does not disturb them.
            jobs = [collect(engine, f"c{i}", "Once upon a time", greedy()) for i in range(4)]
            results = await asyncio.gather(
                *jobs, engine.add_request("bad", [], greedy()), return_exceptions=True
            )
            assert isinstance(results[-1], RequestError)
            assert len({r[0] for r in results[:-1]}) == 1
            with pytest.raises(RequestError, match="out of range"):
                await engine.add_request("bad2", [10**9], greedy())
            with pytest.raises(RequestError, match="over the limit"):
                await engine.add_request("long", list(range(1, 600)), greedy())
            # Closing a stream early aborts the request; its blocks are back before the next step.
            gen = engine.generate("long-run", "Count:", greedy(400, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()
            usage = await engine.call(lambda e: e.kv.pool.usage())
            assert usage == 0  # no block held by a request (the prefix cache may keep some)
            await engine.call(lambda e: e.check_no_leaks())
            assert engine.num_waiting == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_failing_step_fails_in_flight_requests_only() -> None:
    async def main() -> None:
        engine = await started(AsyncEngine(make_engine))
        try:
            core = engine.engine
            assert isinstance(core, FlakyEngine)
            # Armed before the request arrives, so the failing step is the request's own
            # (arming it mid-stream would race the engine thread, which never waits for us).
            core.fail_next.set()
            with pytest.raises(EngineStepError, match="injected fault"):
                await collect(engine, "x", "Count to ten:", greedy(50, ignore_eos=True))
            await engine.call(lambda e: e.check_no_leaks())
            text, _ = await collect(engine, "y", "Hello, my name is", greedy())
            assert text  # the engine thread survived and serves new requests
        finally:
            engine.shutdown()

    asyncio.run(main())


# ---- the HTTP app in process ------------------------------------------------------------------


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def gated() -> Iterator[tuple[ThreadedServer, threading.Event, list[FlakyEngine]]]:
    """A server whose model load waits for `gate`, so the loading phase can be observed."""
    gate = threading.Event()
    built: list[FlakyEngine] = []

    def factory() -> FlakyEngine:
        gate.wait(120)
        built.append(make_engine())
        return built[0]

    srv = ThreadedServer(build_app(AsyncEngine(factory), ["tiny"], log_requests=False))
    yield srv, gate, built
    gate.set()
    srv.close()


def test_health_is_503_until_loaded(gated) -> None:
    srv, gate, _ = gated
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        err = assert_error(http.get("/health"), 503)
        assert err["code"] == "model_loading"
        err = assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert err["code"] == "model_loading"
        assert http.get("/metrics").status_code == 200  # scrapable while loading
        gate.set()
        deadline = time.monotonic() + 120
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_step_failure_is_a_readable_error_and_server_survives(gated) -> None:
    srv, gate, built = gated
    gate.set()
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.05)
        core = built[0]
        body = {"prompt": "Count to ten:", "max_tokens": 50, "ignore_eos": True}
        core.fail_next.set()
        err = assert_error(http.post("/v1/completions", json=body), 500)
        assert "engine step failed" in err["message"] and "Traceback" not in err["message"]
        # Streaming: the status is sent before the failure, so the error comes as an SSE event.
        core.fail_next.set()
        r = http.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine step failed" in error["message"] and error["type"] == "server_error"
        # And the server goes on serving.
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
