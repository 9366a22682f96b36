"""The OpenAI server's errors on the real model: every bad request gets a readable error in
OpenAI's shape (status, type, message), never a 500, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.real_model import loaded_default
from tests.test_server_utils import MODEL, SMALL_ENGINE, assert_error, server_fixtures

PROMPT = "The capital of France is"

server, client, http = server_fixtures(*SMALL_ENGINE)


@pytest.fixture(scope="module")
def tokenizer():
    return loaded_default().tokenizer


# ---- errors -----------------------------------------------------------------------------------

LONG = "hello " * 1100  # > max_model_len 1024 tokens

ERRORS = [
    # (path, body (dict, or raw bytes), status, param)
    ("/v1/completions", b'{"prompt": "hi",', 400, None),
    ("/v1/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000000": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 10**20}, 400, "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "top_logprobs": 3,
            "logprobs": True,
            "n": 200,
        },
        400,
        "n",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": "nope"},
        404,
        "model",
    ),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    ERRORS,
    ids=[f"{i}-{e[0].rsplit('/', 1)[-1]}-{e[2]}" for i, e in enumerate(ERRORS)],
)
def test_error_responses(
    http: httpx.Client, path: str, body: dict | bytes, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, status, param)


def test_over_length_message_says_by_how_much(http: httpx.Client, tokenizer) -> None:
    n = len(tokenizer.encode(LONG))
    err = assert_error(http.post("/v1/completions", json={"prompt": LONG}), 400, "prompt")
    assert f"{n - 1024 + 1} tokens over" in err["message"] and "1024" in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}), 400)
    assert "over the limit" in err["message"]


def test_unknown_route_and_method_are_openai_errors(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    err = assert_error(http.post("/v1/completions", data={"prompt": "hi"}), 400)  # a form, not JSON
    assert "JSON object" in err["message"]


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_server_survives_errors(client: openai.OpenAI) -> None:
    """After all the bad requests above the engine still serves (nothing leaked or crashed)."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
