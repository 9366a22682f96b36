"""Checks of chat input that the pydantic schema cannot express, so that a malformed message is a
400 naming it rather than an exception deep in the chat template or the tool-call renderer."""

from __future__ import annotations

from typing import Any

from inferd.server.errors import APIError

# Arguments the server itself passes to every chat template: chat_template_kwargs may add
# arguments but not replace these (a `tools` string there would reach the template as tools).
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "bos_token", "eos_token"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    clash = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs or {}))
    if clash:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(clash)}: the server passes "
            f"{'it' if len(clash) == 1 else 'them'} to the template itself (use the request's "
            "own fields)",
            param="chat_template_kwargs",
        )


def check_tool_calls(messages: list[dict[str, Any]]) -> None:
    """Each `tool_calls` entry of a message: an object whose `function` is an object with a
    string `name` and `arguments` given as JSON text or an object."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise APIError(400, f"{where}.function must be an object with `name` and "
                               "`arguments`", param="messages")  # fmt: skip
            if not isinstance(fn.get("name"), str):
                raise APIError(400, f"{where}.function.name must be a string", param="messages")
            args = fn.get("arguments", "{}")
            if not isinstance(args, (str, dict)):
                raise APIError(400, f"{where}.function.arguments must be a JSON string or an "
                               "object", param="messages")  # fmt: skip
