"""`inferd serve --engine-process`: the engine loop in a process of its own, end to end with the
real model and the real `openai` client.

The front end keeps its own copy of the tokenizer (it came over a pipe), the engine's answers
come back pickled, and a function sent to the engine (`/reset_prefix_cache`) travels by
cloudpickle. The last test kills the engine process under a running stream: the server must stay
up and say so, in the API's own error shape.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from inferd import LLM
from inferd.engine.engine_proc import FrameReader, write_frame
from inferd.sampling.params import SamplingParams
from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, assert_error, metric

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    # No restarts: the last test kills the engine and reads what a dead one answers.
    srv = RemoteServer("--engine-process", *SMALL_ENGINE, "--max-engine-restarts", "0")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def engine_process(server: RemoteServer) -> psutil.Process:
    children = [
        c
        for c in psutil.Process(server.proc.pid).children()
        if "spawn_main" in " ".join(c.cmdline())
    ]
    assert len(children) == 1, [c.cmdline() for c in children]
    return children[0]


def running(http: httpx.Client) -> tuple[float, float]:
    text = http.get("/metrics").text
    return (
        metric(text, "inferd:num_requests_running", model_name=MODEL),
        metric(text, "inferd:kv_cache_usage_perc", model_name=MODEL),
    )


def test_the_engine_runs_in_its_own_process(server: RemoteServer) -> None:
    engine = engine_process(server)
    assert engine.memory_info().rss > 200 << 20  # the model lives there
    assert "SmolLM2-135M-Instruct" in server.log_text()  # the start-up line from the pipe's info


def test_greedy_text_equals_the_engine_in_process(client: openai.OpenAI) -> None:
    llm = LLM(verbose=False, kv_cache_memory=64 << 20)  # `inferd serve`'s defaults (-q auto)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24))[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.outputs[0].text


def test_chat_structured_output_and_tokenizer(client: openai.OpenAI, http: httpx.Client) -> None:
    # The grammar compiles on a worker thread of the engine process; the chat template renders
    # with the front end's copy of the tokenizer.
    # Greedy, on a prompt whose object the model closes within 16 tokens (with int8 activations
    # and without): it must end by itself, well before max_tokens, as one JSON object.
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}
        ],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 60, content
    assert isinstance(json.loads(content), dict), content
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert (
        http.post("/detokenize", json={"tokens": tokens["tokens"]})
        .json()["prompt"]
        .endswith(PROMPT)
    )


def test_refusals_come_back_as_api_errors(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={"prompt": [10**7]}), 400)
    assert "out of range" in err["message"]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": bad_schema}
    assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert http.post("/reset_prefix_cache").json() == {"reset": True}  # a lambda, run over there


def aborts(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return metric(text, "inferd:request_success_total", model_name=MODEL, finished_reason="abort")


def test_closing_a_stream_frees_its_blocks(http: httpx.Client) -> None:
    before = aborts(http)
    body = {"prompt": "Count: 1, 2,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    # The engine process counts the request aborted (not run to its end) and its blocks are back.
    deadline = time.monotonic() + 60
    while (aborts(http), running(http)) != (before + 1, (0.0, 0.0)):
        assert time.monotonic() < deadline, (aborts(http) - before, running(http))
        time.sleep(0.05)


def test_a_killed_engine_is_reported_not_hung(server: RemoteServer, http: httpx.Client) -> None:
    """Last in this module: it leaves the server without an engine."""
    body = {"prompt": "Count: 1, 2,", "max_tokens": 800, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        engine_process(server).send_signal(signal.SIGKILL)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "engine process stopped" in error["message"]
    err = assert_error(http.get("/health"), 503)
    assert err["code"] == "engine_dead" and "--max-engine-restarts 0" in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
    assert err["code"] == "engine_dead"
    assert server.proc.poll() is None  # the server itself is still up to say so


def test_frames_survive_any_split_of_the_pipe() -> None:
    """The engine's frames arrive in whatever pieces the pipe gives: each comes back whole."""
    rng = random.Random(0)
    frames = [b"", b"x", rng.randbytes(200_000), pickle.dumps({"a": list(range(1000))})] * 3
    read_end, write_end = os.pipe()
    writer = threading.Thread(target=lambda: [write_frame(write_end, f) for f in frames])
    writer.start()
    reader, got = FrameReader(), []
    while len(got) < len(frames):
        got += reader.feed(os.read(read_end, rng.randint(1, 9000)))
    writer.join()
    os.close(read_end)
    os.close(write_end)
    assert got == frames and not reader.partial


def _tiny_engine():
    from inferd.config import CacheConfig, EngineConfig, SchedulerConfig
    from inferd.engine.core import EngineCore

    config = EngineConfig(
        cache=CacheConfig(kv_cache_memory=64 << 20),
        scheduler=SchedulerConfig(max_model_len=512),
        log_stats_interval=0,
    )
    return EngineCore(config, verbose=False)


def test_async_engine_in_a_process_directly() -> None:
    """The AsyncEngine API with `engine_process=True`: streams, a refusal, a call that cannot
    travel (its caller gets the error; the engine goes on), and no blocks leaked."""
    from inferd.engine.async_engine import AsyncEngine
    from inferd.engine.core import RequestError

    cpus = os.sched_getaffinity(0)

    async def main() -> None:
        engine = AsyncEngine(_tiny_engine, engine_process=True)
        engine.start()
        await engine.wait_ready()
        try:
            assert engine.engine is None and engine.info is not None
            params = SamplingParams(temperature=0.0, max_tokens=5)
            updates = [u async for u in engine.generate("a", PROMPT, params)]
            assert updates[-1].output is not None
            assert len(updates[-1].output.outputs[0].token_ids) == 5
            with pytest.raises(RequestError, match="out of range"):
                await engine.add_request("bad", [10**9], params)
            lock = threading.Lock()
            with pytest.raises(TypeError):
                await engine.call(lambda core: lock.locked())  # a lock does not pickle
            assert await engine.call(lambda core: core.max_model_len) == 512
            await engine.call(lambda core: core.check_no_leaks())
        finally:
            engine.shutdown()
        assert not engine.is_alive

    asyncio.run(main())
    assert os.sched_getaffinity(0) == cpus  # a library caller's process is never moved
