"""OpenAI tool calling on top of grammars: checking `tools` / `tool_choice`, telling a model whose
chat template ignores tools about them, the grammar that forces a call, and parsing calls back.

The call format the model is asked for (Hermes-style, which many small instruct models know):
    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
With `tool_choice` "required" or a named function the output is instead constrained to bare JSON:
one `{"name", "arguments"}` object (named) or a non-empty array of them (required), the arguments
matching the function's parameter schema. `parse_tool_calls` reads both forms.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from inferd.structured.params import StructuredOutputsParams


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name → function definition; ToolError naming the bad entry."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -; got {name!r}",
                "tools",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if name in out:
            raise ToolError(f"tools: function {name!r} is defined twice", "tools")
        out[name] = {**fn, "parameters": params}
    return out


def chosen(
    tool_choice: str | dict[str, Any] | None, functions: dict[str, dict[str, Any]]
) -> str | None:
    """Normalize tool_choice: None/"none" → "none", "auto", "required", or a function name."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function; got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "required" and not functions:
            raise ToolError("tool_choice 'required' needs `tools`", "tool_choice")
        return tool_choice if functions or tool_choice == "none" else "none"
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            "tool_choice must look like {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in functions:
        raise ToolError(
            f"tool_choice names function {name!r}, which is not in `tools`", "tool_choice"
        )
    return name


def _call_schema(name: str, fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def forced_call_spec(choice: str, functions: dict[str, dict[str, Any]],
                     parallel: bool = True) -> StructuredOutputsParams | None:  # fmt: skip
    """The grammar for "required" (an array of calls) or a named function (one call)."""
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        return StructuredOutputsParams(json=_call_schema(choice, functions[choice]))
    calls = [_call_schema(n, f) for n, f in functions.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}  # fmt: skip
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def tools_prompt(functions: dict[str, dict[str, Any]]) -> str:
    """A system-prompt section describing the tools, for templates that ignore `tools`."""
    lines = ["You can call these functions:"]
    for name, fn in functions.items():
        sig = {
            "name": name,
            "description": fn.get("description", ""),
            "parameters": fn["parameters"],
        }
        lines.append(json.dumps(sig, ensure_ascii=False))
    lines.append('To call one, reply with only <tool_call>{"name": <function name>, "arguments": '
                 "<arguments object>}</tool_call>. Otherwise answer normally.")  # fmt: skip
    return "\n".join(lines)


def prepare_messages(messages: list[dict[str, Any]], functions: dict[str, dict[str, Any]],
                     template_knows_tools: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Messages for a template without tool support: the tools in the system message, earlier
    assistant tool calls written out as text (the template would drop them)."""
    if template_knows_tools:
        return messages
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>" + json.dumps({"name": c.get("function", {}).get("name"),
                                            "arguments": _loads(c.get("function", {}).get("arguments"))})
                + "</tool_call>" for c in m["tool_calls"]
            )  # fmt: skip
            m = {**m, "content": (m.get("content") or "") + calls}
            m.pop("tool_calls")
        out.append(m)
    if functions:
        section = tools_prompt(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _loads(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _as_calls(value: Any, functions: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in functions):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = _loads(args)
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", item["name"],
                              json.dumps(args, ensure_ascii=False)))  # fmt: skip
    return calls or None


def parse_tool_calls(
    text: str, functions: dict[str, dict[str, Any]]
) -> tuple[str | None, list[ToolCall]]:
    """(content left, tool calls) of a model output; no calls → (text, [])."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            calls = _as_calls(json.loads(stripped), functions)
        except json.JSONDecodeError:
            calls = None
        if calls:
            return None, calls
    if "<tool_call>" in text:
        calls = []
        for body in _TAGGED.findall(text):
            try:
                found = _as_calls(json.loads(body), functions)
            except json.JSONDecodeError:
                found = None
            calls.extend(found or [])
        if calls:
            content = _TAGGED.sub("", text).strip()
            return content or None, calls
    return text, []


def may_become_call(text: str) -> bool:
    """Could this output prefix still turn into a tool call? (streaming holds it back if so)."""
    s = text.lstrip()
    return not s or s.startswith(("{", "[", "<tool_call>")) or "<tool_call>".startswith(s[:11])
