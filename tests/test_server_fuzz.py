"""Fuzzing the whole request schema against the real server: schemathesis over the app's own
`/openapi.json`, and hypothesis strategies built from the pydantic request models (values of the
right type, edge values, and now and then a JSON value of the wrong type). Whatever a client
sends: no response >= 500, no error event in a stream, no traceback in the server log, and the
server still healthy afterwards.

Bounded in time: a small context (--max-model-len), at most 4 sequences a request, at most 8
generated tokens (bodies are capped before they go out), and a fixed number of examples.
"""

from __future__ import annotations

import types
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from inferd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.test_server_utils import RemoteServer

schemathesis = pytest.importorskip("schemathesis")

MAX_NEW = 8


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = RemoteServer(
        "--kv-cache-memory", "64MiB", "--max-model-len", "96", "--log-stats-interval", "0",
        "--max-sequences-per-request", "4",
    )  # fmt: skip
    yield srv
    srv.close()


SETTINGS = settings(
    max_examples=15,
    deadline=None,
    database=None,
    derandomize=True,  # the same cases on every run: a failure reproduces
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)

# ---- strategies from the pydantic models ----------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31, -(2**31), 2**63, -(2**63) - 1, 10**30])
EDGE_TEXT = st.sampled_from(["", " ", "<|im_end|><|im_start|>system\n", "{", "\x00", "é" * 9,
                             "user", "assistant", "function", "text", "json_schema"])  # fmt: skip


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    """Values of a field's annotation: mostly right-typed, with edge values."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return JSON
    if tp is type(None):
        return st.none()
    if origin in (Union, types.UnionType):
        return st.one_of(*(for_type(a) for a in args))
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(for_type(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(for_type(args[0]), for_type(args[1]), max_size=4)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_bodies(tp, wrong=False)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(*[st.integers(0, 8)] * 4, st.integers(-3, 500), EDGE_INTS)
    if tp is float:
        return st.one_of(*[st.floats(0, 1)] * 4, st.floats(-3, 3),
                         st.sampled_from([0.0, 1e308, -1e308, 5e-324]))  # fmt: skip
    if tp is str:
        return st.one_of(*[st.text(min_size=1, max_size=16)] * 4, EDGE_TEXT)
    raise TypeError(f"no strategy for {tp!r}")


def model_bodies(model: type[BaseModel], wrong: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """JSON bodies for `model`: the required fields and up to four optional ones; one value in
    about sixteen of the wrong type (a JSON value of any shape) unless not `wrong` (nested
    models: the body's own fields carry those)."""
    values = {}
    for name, field in model.model_fields.items():
        typed = for_type(field.annotation)
        if name == "model":
            typed = st.none() | st.just("SmolLM2-135M-Instruct") | typed
        values[name] = st.one_of(*[typed] * 15, JSON) if wrong else typed
    required = {n: values[n] for n, f in model.model_fields.items() if f.is_required()}
    optional = sorted(n for n, f in model.model_fields.items() if not f.is_required())
    if not optional:
        return st.fixed_dictionaries(required)
    return st.lists(st.sampled_from(optional), max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({**required, **{n: values[n] for n in chosen}})
    )


def capped(body: Any) -> Any:
    """The body with generation bounded (the fuzz is about input, not long outputs)."""
    if isinstance(body, dict):
        body = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):
            if not isinstance(body.get(key), int) or body[key] > MAX_NEW:
                body[key] = MAX_NEW
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_NEW:
            body["min_tokens"] = MAX_NEW
    return body


STATUSES: dict[str, Counter[int]] = defaultdict(Counter)


def check(response: httpx.Response | Any, what: str) -> None:
    status = response.status_code
    STATUSES[what.split(" ")[0]][status] += 1
    assert status < 500, (what, status, response.text[:500])
    text = response.text
    assert "engine_error" not in text and "internal_error" not in text, (what, text[:500])


# ---- the tests ---------------------------------------------------------------------------------

MODELS = [
    ("/v1/completions", CompletionRequest),
    ("/v1/chat/completions", ChatCompletionRequest),
    ("/tokenize", TokenizeRequest),
    ("/detokenize", DetokenizeRequest),
]


@pytest.mark.parametrize("path,model", MODELS, ids=[p for p, _ in MODELS])
def test_pydantic_model_fuzz(server: RemoteServer, path: str, model: type[BaseModel]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:

        @SETTINGS
        @given(body=model_bodies(model))
        def run(body: dict[str, Any]) -> None:
            check(http.post(path, json=capped(body)), f"{path} {body!r}"[:2000])

        run()


def fuzz_operation(op: Any, url: str) -> None:
    """Cases schemathesis draws for one operation of the OpenAPI document, sent to `url`."""

    @SETTINGS
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        case.body = capped(case.body)
        check(case.call(base_url=url, timeout=120), f"{op.label} {case.body!r}"[:2000])

    run()


def test_openapi_fuzz(server: RemoteServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= {op.label for op in operations}
    for op in operations:
        fuzz_operation(op, server.url)


USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
DEEP_ARGS = '{"a":' * 3000 + "1" + "}" * 3000
HOSTILE = [
    # The 500s found before (each now a 400 naming the problem, or served).
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tools": "x"}}),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": 1}}),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": None}]}, *USER], "tools": TOOLS}),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGS}}]},
        *USER], "tools": TOOLS}),
    ("/v1/chat/completions", {"messages": USER, "guided_json": "[" * 60000}),
    # Served: the fuzz above mostly meets refusals; these go all the way through the engine.
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": USER, "n": 2, "logprobs": True, "top_logprobs": 2,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "<|im_end|><|im_start|>system"}]}], "stop": ["\n", "a"]}),
    ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "echo": True, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"0": 100}, "stop_token_ids": [0],
                         "response_format": {"type": "json_object"}}),
]  # fmt: skip


def test_hostile_bodies(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        statuses = []
        for path, body in HOSTILE:
            r = http.post(path, json=capped(body))
            check(r, f"{path} {body!r}"[:500])
            statuses.append(r.status_code)
    assert statuses[:5] == [400] * 5 and statuses[5:] == [200] * 5, statuses


def test_server_survived(server: RemoteServer) -> None:
    """Runs last in the module: no traceback logged (no 500 nor engine error behind a 200)."""
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    log = server.log_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-5000:]
