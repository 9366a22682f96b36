"""OpenAI tool calling on top of grammars: checking `tools` / `tool_choice`, telling a model whose
chat template ignores tools about them, and the grammar that forces a call.

With `tool_choice` "required" or a named function the output is constrained to bare JSON: one
`{"name", "arguments"}` object (named) or a non-empty array of them (required), the arguments
matching the function's parameter schema. Otherwise the model writes calls in its family's format;
`tool_parsers` reads both back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferd.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from inferd.structured.tool_parsers import ToolParser


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


def prepare_messages(messages: list[dict[str, Any]], functions: dict[str, dict[str, Any]],
                     parser: ToolParser, system_role: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """Messages for a template that ignores `tools`: the tools and how to call them (in `parser`'s
    format) in the system message, or at the head of the first user message where the template
    has no system role; earlier assistant tool calls written out as text (the template would drop
    them)."""
    from inferd.structured.tool_parsers import instruction_for

    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = parser.render_calls(m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + calls
        out.append(m)
    if not functions:
        return out
    section = instruction_for(parser, functions)
    if system_role:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
        return out
    first_user = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
    if first_user is not None:
        m = out[first_user]
        out[first_user] = {**m, "content": f"{section}\n\n{m.get('content') or ''}"}
    return out
