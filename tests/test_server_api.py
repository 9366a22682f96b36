"""The OpenAI-compatible server end to end: the real `inferd serve` with the real default model,
driven by the official `openai` client and by raw HTTP (httpx)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.real_model import loaded_default
from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, metric, server_fixtures

PROMPT = "The capital of France is"


server, client, http = server_fixtures(*SMALL_ENGINE, "--kv-cache-memory", "512MiB", "--max-num-seqs", "256")


@pytest.fixture(scope="module")
def tokenizer():
    return loaded_default().tokenizer


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing on the way."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events


def chat_prompt_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- discovery ------------------------------------------------------------------------------


def test_models_health_version_openapi(
    server: RemoteServer, client: openai.OpenAI, http: httpx.Client
) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(paths)


def test_tokenize_detokenize(http: httpx.Client, tokenizer) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    messages = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["count"] == chat_prompt_len(tokenizer, messages)


# ---- completions ----------------------------------------------------------------------------


def test_completion_shape_and_usage(http: httpx.Client, tokenizer) -> None:
    before = time.time()
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200
    body = r.json()
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert before - 1 <= body["created"] <= time.time() + 1 and body["model"] == MODEL
    (choice,) = body["choices"]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason"}
    assert (
        choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    )
    assert choice["text"]
    prompt_tokens = len(tokenizer.encode(PROMPT))
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached in (0, (prompt_tokens - 1) // 16 * 16)  # 0 unless an earlier test sent PROMPT
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 8,
        "total_tokens": prompt_tokens + 8,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def test_prefix_cache_hits_in_usage_metrics_and_reset(http: httpx.Client, tokenizer) -> None:
    system = "You are a meticulous assistant who answers questions about astronomy. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a planet."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    assert http.post("/reset_prefix_cache").json() == {"reset": True}
    hits0 = metric(_metrics(http), "inferd:prefix_cache_hits_total")
    first = http.post("/v1/chat/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    n = first["usage"]["prompt_tokens"]
    # A later turn of the same conversation (streamed): its whole history prefix is reused.
    follow = {**body, "stream": True, "stream_options": {"include_usage": True},
              "messages": [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                           {"role": "user", "content": "And another?"}]}  # fmt: skip
    events = sse_events(http.post("/v1/chat/completions", json=follow))
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 16 * 16 - 16 > 0
    second = http.post("/v1/chat/completions", json=body).json()
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert metric(_metrics(http), "inferd:prefix_cache_hits_total") > hits0
    _wait_idle(http)
    assert http.post("/reset_prefix_cache").json() == {"reset": True}
    third = http.post("/v1/chat/completions", json=body).json()
    assert third["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_stream_matches_non_stream(client: openai.OpenAI, http: httpx.Client) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # Raw SSE: framing, [DONE], and usage only on the last chunk when asked for.
    r = http.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    assert all(d["object"] == "text_completion" for d in data)
    assert all(d["usage"] is None for d in data[:-1])
    assert data[-1]["choices"] == [] and data[-1]["usage"] == full.usage.model_dump(
        exclude_none=True
    )
    assert "".join(d["choices"][0]["text"] for d in data[:-1]) == full.choices[0].text


def test_completion_prompt_forms_and_echo(client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    two = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Once upon a time"))
    assert two.usage.completion_tokens == 8
    assert two.choices[0].text == by_text.choices[0].text[: len(two.choices[0].text)]
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = text[: text.index(stop)]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "never-appears"]
    )
    choice = stopped.choices[0]
    assert choice.text == cut and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n2_and_seed_reproducibility(client: openai.OpenAI) -> None:
    def run(seed: int, **kw):
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed, **kw
        )

    a, b = run(1234, n=2), run(1234, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20 and a.usage.prompt_tokens == b.usage.prompt_tokens
    others = {run(seed).choices[0].text for seed in (1, 2, 3)}
    assert len(others) > 1, "different seeds should sample differently"
    # Streamed n=2: both choices arrive, each its own text.
    chunks = list(run(1234, n=2, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert [texts[0], texts[1]] == [c.text for c in a.choices]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


# ---- chat -------------------------------------------------------------------------------------


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
]


def test_chat_non_stream_and_stream(client: openai.OpenAI, http: httpx.Client, tokenizer) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    flat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert full.usage.prompt_tokens == chat_prompt_len(tokenizer, flat)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # Usage chunk, raw.
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    # The same prompt again: its full blocks now come from the prefix cache.
    cached = (full.usage.prompt_tokens - 1) // 16 * 16
    expected = {**full.usage.model_dump(exclude_none=True), "prompt_tokens_details": {"cached_tokens": cached}}
    assert last["choices"] == [] and last["usage"] == expected
    first = json.loads(events[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_max_completion_tokens_n2_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 10
    for c in r.choices:
        assert c.finish_reason == "length"
        content = c.logprobs.content
        assert len(content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert "".join(t.token for t in content) == c.message.content


# ---- load, cancellation, metrics --------------------------------------------------------------


def test_256_concurrent_streams(client: openai.OpenAI, server: RemoteServer) -> None:
    prompts = [PROMPT, "Once upon a time", "The best way to learn is", "def fibonacci(n):"]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompts[i % 4],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def main() -> list[tuple[str, str | None, int]]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(limits=limits, timeout=600) as h:
            aclient = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="x", http_client=h, max_retries=0
            )
            return await asyncio.gather(*(one(aclient, i) for i in range(256)))

    results = asyncio.run(main())
    assert len(results) == 256
    for i, (text, finish, tokens) in enumerate(results):
        assert (text, finish, tokens) == (expected[i % 4], "length", 8), i


def _metrics(http: httpx.Client) -> str:
    r = http.get("/metrics")
    assert r.status_code == 200
    return r.text


def _wait_idle(http: httpx.Client, timeout: float = 120.0) -> str:
    """Poll /metrics until nothing runs and no KV block is held by a request.

    (`kv_cache_usage_perc` counts blocks only the prefix cache holds as available: they are
    evictable, which is what "back in the pool" means once prefix caching is on.)"""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(http)
        idle = (
            metric(text, "inferd:num_requests_running") == 0
            and metric(text, "inferd:num_requests_waiting") == 0
            and metric(text, "inferd:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def _poll_metrics(
    http: httpx.Client, done: Callable[[str], bool], what: str, timeout: float = 60.0
) -> str:
    """Scrape /metrics until `done(text)`, at most `timeout` s. The gauges are the stats snapshot
    the engine sends along with its steps (at once when a request starts or ends, otherwise now
    and then): a state shows up with the engine's next such message, not at a given instant."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(http)
        if done(text):
            return text
        assert time.monotonic() < deadline, f"{what}: not in /metrics after {timeout} s:\n{text}"
        time.sleep(0.02)


def test_cancelled_stream_frees_blocks(server: RemoteServer, http: httpx.Client) -> None:
    before = _wait_idle(http)
    finished = {
        reason: metric(before, "inferd:request_success_total", finished_reason=reason)
        for reason in ("abort", "length")
    }
    body = {
        "prompt": PROMPT,
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=300) as own,
        own.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                # Token chunks of a request still running: an error event or a finish would say
                # here why the gauges below cannot show it.
                assert "error" not in chunk and chunk["choices"][0]["finish_reason"] is None, chunk
                chunks.append(chunk)
                if len(chunks) == 3:
                    break

        def running(text: str) -> bool:
            return (
                metric(text, "inferd:num_requests_running") == 1
                and metric(text, "inferd:kv_cache_usage_perc") > 0
            )

        _poll_metrics(http, running, "the streaming request running and holding blocks")
        # Leaving the block closes the connection mid-stream: the server must abort the request.

    # The engine's own word that it processed the abort: the request counted as finished by one.
    def aborted(text: str) -> bool:
        return (
            metric(text, "inferd:request_success_total", finished_reason="abort")
            == finished["abort"] + 1
        )

    _poll_metrics(http, aborted, "the request's abort")
    after = _wait_idle(http)
    assert metric(after, "inferd:num_requests_running") == 0, after
    assert metric(after, "inferd:num_requests_waiting") == 0, after
    assert metric(after, "inferd:kv_cache_usage_perc") == 0, after  # its blocks are back
    counts = {
        reason: metric(after, "inferd:request_success_total", finished_reason=reason)
        for reason in finished
    }
    # Counted once, as aborted: it did not run to its end (1000 tokens) before the abort.
    assert counts == {"abort": finished["abort"] + 1, "length": finished["length"]}, after


def test_disconnected_non_stream_request_is_aborted(
    server: RemoteServer, http: httpx.Client
) -> None:
    before = _wait_idle(http)
    aborts = metric(before, "inferd:request_success_total", finished_reason="abort")
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with (
        httpx.Client(base_url=server.url, timeout=httpx.Timeout(300, read=1.0)) as own,
        pytest.raises(httpx.ReadTimeout),
    ):
        own.post("/v1/completions", json=body)
    after = _wait_idle(http)
    assert metric(after, "inferd:kv_cache_usage_perc") == 0
    assert metric(after, "inferd:request_success_total", finished_reason="abort") == aborts + 1


def test_metrics(http: httpx.Client, client: openai.OpenAI) -> None:
    before = _wait_idle(http)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = _metrics(http)
    for name in (
        "inferd:time_to_first_token_seconds_count",
        "inferd:inter_token_latency_seconds_count",
        "inferd:e2e_request_latency_seconds_count",
        "inferd:request_queue_time_seconds_count",
        "inferd:num_requests_running",
        "inferd:num_requests_waiting",
        "inferd:kv_cache_usage_perc",
        "inferd:num_preemptions_total",
        "inferd:prefix_cache_queries_total",
        "inferd:prefix_cache_hits_total",
    ):
        metric(after, name, model_name=MODEL)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("inferd:generation_tokens_total") == 5
    assert delta("inferd:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("inferd:request_success_total", finished_reason="length") == 1
    assert delta("inferd:time_to_first_token_seconds_count") == 1
    assert delta("inferd:e2e_request_latency_seconds_count") == 1
    assert delta("inferd:request_queue_time_seconds_count") == 1
    assert delta("inferd:inter_token_latency_seconds_count") == 4
    assert delta("inferd:prefix_cache_queries_total") == r.usage.prompt_tokens
