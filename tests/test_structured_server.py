"""Structured output and tool calling through the real server with the official `openai` client:
outputs parse and validate over many seeds (n > 1), streamed tool calls concatenate to valid
JSON, and bad specs are 400s naming the problem."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer

SCHEMA = {
    "$defs": {"size": {"enum": ["S", "M", "L"]}},
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 10},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "size": {"$ref": "#/$defs/size"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["item", "qty", "size"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
JSON_OBJECT_ASK = "Give a JSON object with a person's name and age."


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    srv = RemoteServer(*SMALL_ENGINE, "--structured-output-timeout", "20")
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    finally:
        srv.close()


def test_chat_json_schema_and_completions_guided_json(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "An order as JSON."}], n=6,
        temperature=0.7, seed=11, max_tokens=40, response_format=fmt,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="Order:", n=4, temperature=0.7, seed=5,
                                  max_tokens=40, extra_body={"guided_json": SCHEMA})  # fmt: skip
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_json_object(client: openai.OpenAI) -> None:
    regex = r"\d{3}-[a-z]{3}"
    r = client.completions.create(model=MODEL, prompt=["Code:", "Id:"], n=3, temperature=0.7,
                                  seed=2, max_tokens=10, extra_body={"guided_regex": regex})  # fmt: skip
    assert len(r.choices) == 6 and all(re.fullmatch(regex, c.text) for c in r.choices)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick one."}], n=5, temperature=0.7,
        seed=3, max_tokens=4, extra_body={"guided_choice": ["alpha", "beta"]},
    )  # fmt: skip
    assert {c.message.content for c in r.choices} <= {"alpha", "beta"}
    # Greedy, on a prompt whose object the model closes within 13 tokens (with int8 activations
    # and without): it must end by itself, well before max_tokens, as one JSON object.
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": JSON_OBJECT_ASK}],
        temperature=0, max_tokens=60, response_format={"type": "json_object"},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens < 60, c.message.content
    assert isinstance(json.loads(c.message.content), dict), c.message.content


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_and_required_tool_calls(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                       n=4, temperature=0.7, seed=9, max_tokens=40)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        _check_call(call.function.name, call.function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, n=4, temperature=0.7, seed=1,
                                       max_tokens=40)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)

    # The result goes back as a `tool` message; the next turn runs.
    call = r.choices[0].message.tool_calls[0]
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=5,
                                       temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_calls_concatenate_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=3, temperature=0.7,
        seed=4, max_tokens=40, stream=True,
    )  # fmt: skip
    calls: dict[tuple[int, int], dict] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault((ch.index, tc.index), {"name": "", "args": "", "id": None})
                if tc.id:
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["args"] += tc.function.arguments or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert {i for i, _ in calls} == {0, 1, 2}
    for entry in calls.values():
        assert entry["id"]
        _check_call(entry["name"], entry["args"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         None, "strin"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, None, "uniqueItems"),
        ({"guided_regex": "a(b"}, None, "regex"),
        ({"guided_grammar": "root ::= ("}, None, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ],
)  # fmt: skip
def test_bad_structured_requests_are_400(client: openai.OpenAI, body, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    err = info.value.body
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param
