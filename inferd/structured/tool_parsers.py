"""How each model family writes tool calls, and reading them back (vLLM's `--tool-call-parser`).

- hermes (Qwen2.5/3, Hermes, and what inferd asks of a model whose template ignores tools):
      <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
- mistral (Mistral 7B v0.3, Mixtral, Nemo; the later form of Mistral Small / Magistral too):
      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
- llama3_json (Llama 3.1-3.3 with JSON tools): the reply is the call, several joined by "; ",
  optionally after "<|python_tag|>":
      {"name": "get_weather", "parameters": {"city": "Paris"}}

Every parser also reads the bare JSON a forced `tool_choice` produces (one call object or an array
of them). "auto" picks the parser from markers in the chat template.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from typing import Any

from inferd.structured.tools import ToolCall

Functions = dict[str, dict[str, Any]]
_DECODER = json.JSONDecoder()


class ToolParser(ABC):
    """Reads a family's tool calls out of a completed output, and says, for streaming, where in a
    partial output a call may begin (text before it can go out as content at once)."""

    name: str
    # The call marker is a special token (decoding must keep it): the request's output is
    # detokenized with skip_special_tokens off when tools are given.
    needs_special_tokens: bool = False

    def parse(self, text: str, functions: Functions) -> tuple[str | None, list[ToolCall]]:
        """(content left, calls); an output with no valid call is all content: (text, [])."""
        calls = _bare_json_calls(text, functions, self.new_id)
        if calls:
            return None, calls
        return self._parse(text, functions)

    def call_start(self, text: str) -> int:
        """Where a call may begin in this partial output: `len(text)` if nowhere. Text before the
        returned index is content whatever comes next."""
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{[":
            return 0  # bare JSON (a forced call), or nothing yet to judge by
        return self._call_start(text)

    @abstractmethod
    def _parse(self, text: str, functions: Functions) -> tuple[str | None, list[ToolCall]]: ...

    @abstractmethod
    def _call_start(self, text: str) -> int: ...

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """Past calls ({"name", "arguments"} objects) as this family writes them in a reply."""

    @abstractmethod
    def instruction(self) -> str:
        """How to call a tool, for the system message of a template that ignores `tools`."""

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


def _marker_start(text: str, marker: str) -> int:
    """The index of `marker` in `text`, or of a suffix of `text` that may begin it; else len."""
    found = text.find(marker)
    if found != -1:
        return found
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _loads(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except (json.JSONDecodeError, RecursionError):
        return text


def as_calls(value: Any, functions: Functions, new_id: Any) -> list[ToolCall] | None:
    """One call object or a list of them, each naming a known function with an arguments object
    (under "arguments" or Llama's "parameters", JSON text or an object); None if anything is off."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in functions):
            return None
        args = _loads(item.get("arguments", item.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(new_id(), item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def _bare_json_calls(text: str, functions: Functions, new_id: Any) -> list[ToolCall] | None:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        return as_calls(json.loads(stripped), functions, new_id)
    except (json.JSONDecodeError, RecursionError):
        return None


def _call_json(call: dict[str, Any], args_key: str = "arguments") -> str:
    fn = call.get("function", call)
    return json.dumps({"name": fn.get("name"), args_key: _loads(fn.get("arguments"))},
                      ensure_ascii=False)  # fmt: skip


def _describe(functions: Functions) -> list[str]:
    lines = ["You can call these functions:"]
    for name, fn in functions.items():
        sig = {
            "name": name,
            "description": fn.get("description", ""),
            "parameters": fn["parameters"],
        }
        lines.append(json.dumps(sig, ensure_ascii=False))
    return lines


class HermesParser(ToolParser):
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _parse(self, text: str, functions: Functions) -> tuple[str | None, list[ToolCall]]:
        if self._OPEN not in text:
            return text, []
        calls: list[ToolCall] = []
        for body in self._TAGGED.findall(text):
            try:
                calls.extend(as_calls(json.loads(body), functions, self.new_id) or [])
            except (json.JSONDecodeError, RecursionError):
                pass
        if not calls:
            return text, []
        return self._TAGGED.sub("", text).strip() or None, calls

    def _call_start(self, text: str) -> int:
        return _marker_start(text, self._OPEN)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "".join(f"{self._OPEN}{_call_json(c)}{self._CLOSE}" for c in calls)

    def instruction(self) -> str:
        return ('To call one, reply with only <tool_call>{"name": <function name>, "arguments": '
                "<arguments object>}</tool_call>. Otherwise answer normally.")  # fmt: skip


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens
    _MARKER, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _ID_CHARS = string.ascii_letters + string.digits

    def new_id(self) -> str:
        # Mistral's chat template refuses tool call ids that are not 9 letters and digits.
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))

    def _parse(self, text: str, functions: Functions) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self._MARKER)
        if start == -1:
            return text, []
        content = text[:start].strip() or None
        calls: list[ToolCall] = []
        for part in text[start:].split(self._MARKER)[1:]:
            part = part.strip()
            if part.startswith("["):  # v0.3: a JSON array of {"name", "arguments"}
                try:
                    value, _ = _DECODER.raw_decode(part)
                except (json.JSONDecodeError, RecursionError):
                    return text, []
                found = as_calls(value, functions, self.new_id)
            else:  # name[ARGS]{...} (or name[CALL_ID]id[ARGS]{...})
                found = self._name_args(part, functions)
            if not found:
                return text, []
            calls.extend(found)
        return content, calls

    def _name_args(self, part: str, functions: Functions) -> list[ToolCall] | None:
        name, sep, rest = part.partition(self._ARGS)
        name = name.split(self._CALL_ID, 1)[0].strip()
        if not sep:
            return None
        try:
            args, _ = _DECODER.raw_decode(rest.strip())
        except (json.JSONDecodeError, RecursionError):
            return None
        return as_calls({"name": name, "arguments": args}, functions, self.new_id)

    def _call_start(self, text: str) -> int:
        return _marker_start(text, self._MARKER)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{self._MARKER}[{', '.join(_call_json(c) for c in calls)}]"

    def instruction(self) -> str:
        return ('To call functions, reply with only [TOOL_CALLS][{"name": <function name>, '
                '"arguments": <arguments object>}, ...]. Otherwise answer normally.')  # fmt: skip


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def _parse(self, text: str, functions: Functions) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self._TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                value, end = _DECODER.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError):
                return text, []
            found = as_calls(value, functions, self.new_id)
            if not found:
                return text, []
            calls.extend(found)
            pos = end
            rest = body[pos:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return text, []
            pos = len(body) - len(rest[1:].lstrip())
        return None, calls

    def _call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if self._TAG.startswith(stripped[: len(self._TAG)]):
            return 0  # the tag, or a beginning of it
        return len(text)  # a reply that does not open with the call is content

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_call_json(c, "parameters") for c in calls)

    def instruction(self) -> str:
        return ('To call a function, reply with only {"name": <function name>, "parameters": '
                "<arguments object>}. Otherwise answer normally.")  # fmt: skip


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), MistralParser(), Llama3JsonParser())
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)


def detect_tool_parser(chat_template: str | None) -> ToolParser:
    """The parser whose markers the chat template writes; hermes when it shows none (inferd then
    describes the tools in hermes' format itself)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return TOOL_PARSERS["mistral"]
    if "<tool_call>" in t:
        return TOOL_PARSERS["hermes"]
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return TOOL_PARSERS["llama3_json"]
    return TOOL_PARSERS["hermes"]


def tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `--tool-call-parser NAME` asks for ("auto": from the template's markers)."""
    if name == "auto":
        return detect_tool_parser(chat_template)
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {name!r} is not known; choose one of {', '.join(TOOL_PARSER_CHOICES)}"
        )
    return TOOL_PARSERS[name]


def instruction_for(parser: ToolParser, functions: Functions) -> str:
    """A system-prompt section describing the tools and how to call them."""
    return "\n".join([*_describe(functions), parser.instruction()])


class CallStream:
    """One streamed choice's text with tools: content goes out as soon as it cannot be part of a
    call; from where a call may begin, text is held until the choice ends and then parsed. The
    calls found are those `ToolParser.parse` finds in the whole text."""

    def __init__(self, parser: ToolParser, functions: Functions) -> None:
        self.parser = parser
        self.functions = functions
        self.text = ""
        self.sent = 0  # text[:sent] went out as content; no call begins in it

    def feed(self, delta: str) -> str:
        """Content to send now."""
        self.text += delta
        start = self.parser.call_start(self.text)
        if start <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : start], start
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls) once the choice has ended."""
        held = self.text[self.sent :]
        content, calls = self.parser.parse(held, self.functions)
        return (content or "", calls) if calls else (held, [])
