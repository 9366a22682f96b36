"""`inferd serve --stream-interval N` (SGLang's flag): a stream's first chunk goes out at once,
then each chunk carries N tokens (the last what is left), with the same text, logprobs and
usage as one chunk per token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, metric

from inferd.cli import main

PROMPT = "The capital of France is"


# The engine loop holds the news back, in its own process (the default) or on a thread.
@pytest.fixture(scope="module", params=["--engine-process", "--no-engine-process"])
def server(request) -> Iterator[RemoteServer]:
    srv = RemoteServer(*SMALL_ENGINE, "--stream-interval", "4", request.param)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _generated(server: RemoteServer) -> float:
    return metric(httpx.get(f"{server.url}/metrics").text, "inferd:generation_tokens_total")


def test_completion_chunks_hold_four_tokens_after_the_first(
    client: openai.OpenAI, server: RemoteServer
) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 1}
    full = client.completions.create(**kw)
    before = _generated(server)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    with_text = [c for c in chunks if c.choices]
    # 10 tokens: the first alone, then 4, 4 and the remaining 1 with the finish.
    assert [len(c.choices[0].logprobs.tokens) for c in with_text] == [1, 4, 4, 1]
    assert "".join(c.choices[0].text for c in with_text) == full.choices[0].text
    tokens = [t for c in with_text for t in c.choices[0].logprobs.tokens]
    assert tokens == full.choices[0].logprobs.tokens
    token_logprobs = [lp for c in with_text for lp in c.choices[0].logprobs.token_logprobs]
    assert token_logprobs == pytest.approx(full.choices[0].logprobs.token_logprobs)
    assert [c.choices[0].finish_reason for c in with_text] == [None, None, None, "length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert _generated(server) == before + 10  # the held steps' metrics arrive too


def test_chat_n2_streams_each_choice_in_chunks(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}],
          "max_tokens": 9, "temperature": 0, "n": 2}  # fmt: skip
    full = client.chat.completions.create(**kw)
    texts, pieces = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                texts[choice.index] += choice.delta.content
                pieces[choice.index] += 1
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert all(1 < n <= 3 for n in pieces.values()), pieces  # 9 tokens: 1 + 4 + 4 at most


def test_stream_interval_below_one_is_refused(capsys) -> None:
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--stream-interval", bad])
        assert e.value.code == 2
        assert "--stream-interval" in capsys.readouterr().err
