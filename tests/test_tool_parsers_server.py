"""Tool calls in each family's format through the real server (the default model, its output held
to the family's shape by a regex), streamed and not; a chat template's own refusal is a 400 naming
its reason. Two servers: Mistral's template (auto picks the mistral parser), and Gemma's template
(no system role) with `--tool-call-parser llama3_json`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, assert_error

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
PARIS = {"city": "Paris", "unit": "celsius"}
MISTRAL_OUTPUT = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
LLAMA_OUTPUT = (
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "add", "parameters": {"a": 2, "b": 3}}'
)


def _literal(text: str) -> str:
    """A regex matching exactly `text` (for the output to take the family's shape)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _server(*args: str) -> Iterator[openai.OpenAI]:
    srv = RemoteServer(*SMALL_ENGINE, *args)
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        srv.close()


@pytest.fixture(scope="module")
def mistral() -> Iterator[openai.OpenAI]:
    yield from _server("--chat-template", str(TEMPLATES / "mistral_v03.jinja"))


@pytest.fixture(scope="module")
def gemma_llama3() -> Iterator[openai.OpenAI]:
    yield from _server("--chat-template", str(TEMPLATES / "gemma2.jinja"),
                       "--tool-call-parser", "llama3_json")  # fmt: skip


def _ask(client: openai.OpenAI, output: str, stream: bool, messages=ASK):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=100, stream=stream,
        extra_body={"guided_regex": _literal(output)},
    )  # fmt: skip


def _streamed(chunks) -> tuple[list[str], dict[int, dict], str | None]:
    """(content deltas in order, calls by index with their concatenated arguments, finish)."""
    content, calls, finish = [], {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_mistral_calls(mistral: openai.OpenAI) -> None:
    r = _ask(mistral, MISTRAL_OUTPUT, stream=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == PARIS
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # what Mistral's template accepts back

    content, calls, finish = _streamed(_ask(mistral, MISTRAL_OUTPUT, stream=True))
    assert finish == "tool_calls" and "".join(content).strip() == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", PARIS)
    ]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"])

    # The call and its result go back; Mistral's template renders them (it checks the id).
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]  # fmt: skip
    r = mistral.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_template_refusal_is_a_400_naming_it(mistral, gemma_llama3) -> None:
    for client, messages, reason in (
        (gemma_llama3, [{"role": "system", "content": "Be brief."}, *ASK],
         "System role not supported"),
        (mistral, [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "21"}],
         "Tool call IDs should be alphanumeric strings with length 9!"),
    ):  # fmt: skip
        for stream in (False, True):
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}
            r = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=60)
            err = assert_error(r, 400, "messages")
            assert err["type"] == "invalid_request_error" and err["code"] == "chat_template_error"
            assert reason in err["message"] and "chat template" in err["message"]
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        gemma_llama3.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "x"}, *ASK], max_tokens=2
        )


def test_llama3_json_calls_with_a_template_without_system_role(gemma_llama3) -> None:
    """Gemma's template ignores tools and refuses a system message: the tools go at the head of
    the first user turn instead, and the calls come back in Llama 3's JSON."""
    plain = gemma_llama3.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    r = _ask(gemma_llama3, LLAMA_OUTPUT, stream=False)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools were described
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    want = [("get_weather", PARIS), ("add", {"a": 2, "b": 3})]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == want
    content, calls, finish = _streamed(_ask(gemma_llama3, LLAMA_OUTPUT, stream=True))
    assert finish == "tool_calls" and "".join(content) == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want
