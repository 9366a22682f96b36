"""Tool calls as each family writes them (hermes, mistral, llama3_json) read back, whole and
streamed in pieces; the parser picked from the families' own chat templates; the templates render
tools and past calls in inferd's sandbox."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from inferd.loader.tokenizer import ChatTemplateError, _compile_template
from inferd.structured.tool_parsers import (
    TOOL_PARSERS,
    CallStream,
    detect_tool_parser,
    instruction_for,
    tool_parser,
)
from inferd.structured.tools import check_tools, prepare_messages

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
FUNCTIONS = check_tools(TOOLS)
PARIS = {"city": "Paris", "unit": "celsius"}

# (parser, model output, content left, [(name, arguments)]): outputs shaped as the families write.
HERMES_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
    "</tool_call>"
)
MISTRAL_V3 = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "add", "arguments": {"a": 2, "b": 3}}]'
)
MISTRAL_AFTER_TEXT = (
    'I will look it up. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 1}}]'
)
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add'
    '[ARGS]{"a": 2, "b": 3}'
)
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "add", "parameters": {"a": 2, "b": 3}}'
)
BOTH = [("get_weather", PARIS), ("add", {"a": 2, "b": 3})]
CASES = [
    ("hermes", HERMES_ONE, None, [("get_weather", PARIS)]),
    ("hermes", HERMES_TWO, "Let me check.", BOTH),
    ("mistral", MISTRAL_V3, None, BOTH),
    ("mistral", MISTRAL_AFTER_TEXT, "I will look it up.", [("add", {"a": 1, "b": 1})]),
    ("mistral", MISTRAL_V11, None, BOTH),
    ("llama3_json", LLAMA_ONE, None, [("get_weather", PARIS)]),
    ("llama3_json", LLAMA_TWO, None, BOTH),
]
# Outputs that are not calls: all of it is content.
NOT_CALLS = [
    ("hermes", "It is sunny in Paris."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # bad JSON
    ("hermes", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'),  # unknown function
    ("mistral", "Paris is sunny [TOOLS] not a call"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": "nope"}]'),
    ("llama3_json", 'Here you go: {"name": "add", "parameters": {"a": 1, "b": 2}}'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some'),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "output", "content", "want"), CASES)
def test_family_outputs_parse(name: str, output: str, content, want) -> None:
    parser = TOOL_PARSERS[name]
    got_content, calls = parser.parse(output, FUNCTIONS)
    assert got_content == content
    assert _calls(calls) == want
    assert len({c.id for c in calls}) == len(calls)
    if name == "mistral":  # its template refuses any other id
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)


@pytest.mark.parametrize(("name", "output"), NOT_CALLS)
def test_other_outputs_are_content(name: str, output: str) -> None:
    assert TOOL_PARSERS[name].parse(output, FUNCTIONS) == (output, [])


@pytest.mark.parametrize("name", list(TOOL_PARSERS))
def test_forced_calls_parse_with_every_parser(name: str) -> None:
    """`tool_choice` required / named constrain the output to bare JSON, whatever the family."""
    parser = TOOL_PARSERS[name]
    one = '{"name": "add", "arguments": {"a": 4, "b": 5}}'
    assert _calls(parser.parse(one, FUNCTIONS)[1]) == [("add", {"a": 4, "b": 5})]
    both = f'[{one}, {{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}]'
    assert _calls(parser.parse(both, FUNCTIONS)[1]) == [("add", {"a": 4, "b": 5}),
                                                        ("get_weather", PARIS)]  # fmt: skip


def _stream(name: str, output: str, seed: int) -> tuple[list[str], str, list]:
    """The output fed in random pieces of 1-6 characters: (content pieces sent while running,
    content at the end, calls)."""
    rng = random.Random(seed)
    stream = CallStream(TOOL_PARSERS[name], FUNCTIONS)
    sent, pos = [], 0
    while pos < len(output):
        step = rng.randint(1, 6)
        sent.append(stream.feed(output[pos : pos + step]))
        pos += step
    tail, calls = stream.finish()
    return [s for s in sent if s], tail, calls


@pytest.mark.parametrize(("name", "output", "content", "want"), CASES)
def test_streamed_outputs_give_the_same_calls(name, output, content, want) -> None:
    for seed in range(5):
        sent, tail, calls = _stream(name, output, seed)
        assert _calls(calls) == want
        assert ("".join(sent) + tail).strip() == (content or "")
        if content:  # the text before the call went out before the end
            assert "".join(sent).strip() == content


@pytest.mark.parametrize(("name", "output"), NOT_CALLS)
def test_streamed_content_is_all_of_it(name: str, output: str) -> None:
    for seed in range(3):
        sent, tail, calls = _stream(name, output, seed)
        assert calls == [] and "".join(sent) + tail == output


def test_streamed_plain_answer_is_not_held_back() -> None:
    """Text that cannot begin a call goes out as it comes (only a possible marker start waits)."""
    stream = CallStream(TOOL_PARSERS["hermes"], FUNCTIONS)
    assert stream.feed("It is") == "It is"
    assert stream.feed(" sunny <tool") == " sunny "
    assert stream.feed("box> yes") == "<toolbox> yes"
    llama = CallStream(TOOL_PARSERS["llama3_json"], FUNCTIONS)
    assert llama.feed("") == "" and llama.feed("Sure") == "Sure"
    assert llama.feed(', {"name": 1}') == ', {"name": 1}'


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("qwen25.jinja", "hermes"),
        ("mistral_v03.jinja", "mistral"),
        ("llama31.jinja", "llama3_json"),
        ("gemma2.jinja", "hermes"),
    ],
)
def test_auto_picks_the_parser_from_the_template(template: str, parser: str) -> None:
    source = (TEMPLATES / template).read_text()
    assert detect_tool_parser(source).name == parser
    assert tool_parser("auto", source).name == parser
    assert tool_parser("llama3_json", source).name == "llama3_json"  # the flag wins
    with pytest.raises(ValueError, match="'pythonic' is not known.*hermes, mistral, llama3_json"):
        tool_parser("pythonic", source)


def _render(template: str, messages, **kw) -> str:
    return _compile_template((TEMPLATES / template).read_text()).render(
        messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True, **kw
    )


def test_family_templates_render_tools_and_past_calls() -> None:
    """The round trip a client makes: the template shows the tools, the model calls, the call and
    its result go back in the next request in each family's own shape."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for template, name in (("qwen25.jinja", "hermes"), ("mistral_v03.jinja", "mistral"),
                           ("llama31.jinja", "llama3_json")):  # fmt: skip
        parser = TOOL_PARSERS[name]
        first = _render(template, ask, tools=TOOLS)
        assert "get_weather" in first and "Weather in a city" in first
        output = parser.render_calls([{"name": "get_weather", "arguments": json.dumps(PARIS)}])
        _, [call] = parser.parse(output, FUNCTIONS)
        follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]  # fmt: skip
        second = _render(template, follow, tools=TOOLS)
        # The call and its result come back in the turns after the question.
        later = second[second.index("Weather in Paris?") :]
        assert "get_weather" in later and "Paris" in later and "temp" in later, template


def test_tools_described_for_templates_that_ignore_them() -> None:
    """A template without tools gets them in the system message, in the parser's call format, or
    at the head of the first user message when it has no system role (Gemma)."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    parser = TOOL_PARSERS["llama3_json"]
    with_system = prepare_messages(ask, FUNCTIONS, parser)
    assert with_system[0] == {"role": "system", "content": instruction_for(parser, FUNCTIONS)}
    assert '"parameters"' in with_system[0]["content"]
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        _render("gemma2.jinja", with_system)
    in_user = prepare_messages(ask, FUNCTIONS, parser, system_role=False)
    text = _render("gemma2.jinja", in_user)
    assert text.startswith("<s><start_of_turn>user\nYou can call these functions:")
    assert text.endswith("Weather in Paris?<end_of_turn>\n<start_of_turn>model\n")


def test_offline_chat_template_refusal_is_a_value_error(tiny_llama_gguf) -> None:
    from inferd import LLM, SamplingParams

    llm = LLM(str(tiny_llama_gguf.path), kv_cache_memory=1 << 20, dtype="float32", device="cpu",
              verbose=False)  # fmt: skip
    gemma = (TEMPLATES / "gemma2.jinja").read_text()
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="refuses these messages: System role not supported"):
        llm.chat(system, SamplingParams(max_tokens=2), chat_template=gemma, use_tqdm=False)
    [out] = llm.chat(system[1:], SamplingParams(max_tokens=2), chat_template=gemma, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
