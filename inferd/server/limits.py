"""Admission control: what one request may ask of the server, checked before any engine work.

Every limit is a flag with a default that no ordinary client meets; a request over one is a 400 in
OpenAI's error shape whose message names the flag, whose `param` names the field and whose `code`
is `limit_exceeded`. The engine loop runs single-threaded and checks stop strings, stop token ids
and logit biases per generated token: these bounds keep one request from slowing every other.

Priority (vLLM's `--scheduling-policy`): under `fcfs` every request runs in arrival order and a
non-zero `priority` is refused; under `priority` lower values run first, values are bounded by
`--max-priority`, and values below the default (0), which jump the queue, need `--admin-api-key`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from inferd.server.errors import APIError

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_sequences_per_request: int = 256  # prompts × n × best_of
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300
    max_tools: int = 128
    max_schema_bytes: int = 65536  # response_format / guided_* / tools, as compact JSON
    max_json_depth: int = 64  # nesting of any JSON value in the request
    max_queue_len: int | None = 1024  # engine requests waiting to be scheduled; None: no limit
    max_concurrent_prompts: int = 8  # a many-prompt request's prompts in the engine at once
    scheduling_policy: str = "fcfs"
    max_priority: int = 1000  # |priority| under --scheduling-policy priority
    admin_api_key: str | None = None

    def __post_init__(self) -> None:
        for _, name, _ in _FLAGS:
            value, least = getattr(self, name), 0 if name == "max_priority" else 1
            if value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"--max-queue-len must be >= 0, got {self.max_queue_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}")


# (flag, field of AdmissionLimits, help) for the integer limits.
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--max-sequences-per-request", "max_sequences_per_request",
     "sequences one request may start: prompts × n × best_of"),
    ("--max-stop-strings", "max_stop_strings", "entries of `stop`"),
    ("--max-stop-string-chars", "max_stop_string_chars", "characters of each stop string"),
    ("--max-stop-token-ids", "max_stop_token_ids", "entries of `stop_token_ids`"),
    ("--max-logit-bias", "max_logit_bias", "entries of `logit_bias`"),
    ("--max-tools", "max_tools", "entries of `tools`"),
    ("--max-schema-bytes", "max_schema_bytes",
     "size of response_format, guided_* and tools, as compact JSON"),
    ("--max-json-depth", "max_json_depth", "nesting depth of any JSON value in a request"),
    ("--max-concurrent-prompts", "max_concurrent_prompts",
     ("prompts of one /v1/completions request in the engine at once (the rest wait their "
      "turn, so other users' requests interleave)")),
    ("--max-priority", "max_priority",
     "bound on |priority| under --scheduling-policy priority"),
)  # fmt: skip


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The admission flags, in a group of their own."""
    g = parser.add_argument_group("admission limits (a request over one gets a 400 naming it)")
    defaults = AdmissionLimits()
    for flag, name, text in _FLAGS:
        default = getattr(defaults, name)
        g.add_argument(flag, type=int, default=default, help=f"{text} (default: {default})")
    g.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: arrival order, a non-zero `priority` is refused; priority: lower `priority` "
        "runs first (values below 0 need --admin-api-key)",
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="a key (also accepted as an API key) whose requests may set priority below 0",
    )


def limits_from_args(args: argparse.Namespace) -> AdmissionLimits:
    kwargs: dict[str, Any] = {name: getattr(args, name) for _, name, _ in _FLAGS}
    queue = getattr(args, "max_queue_len", 1024)
    return AdmissionLimits(
        **kwargs,
        max_queue_len=None if queue == 0 else queue,
        scheduling_policy=args.scheduling_policy,
        admin_api_key=args.admin_api_key,
    )


def _refuse(message: str, flag: str, value: int, param: str) -> APIError:
    return APIError(400, f"{message}; the limit is {value} ({flag})", param=param,
                    code="limit_exceeded")  # fmt: skip


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted without recursion; stops counting
    once past `limit` (what was found so far is then returned)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth) for c in children)
    return deepest


def _json_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    try:
        return len(json.dumps(value, separators=(",", ":")).encode())
    except (TypeError, ValueError, RecursionError):
        return 1 << 62  # not serializable: too large by definition


def num_prompts(prompt: Any) -> int:
    """Prompts in a /v1/completions `prompt` (a string, token ids, or a list of either)."""
    if isinstance(prompt, str) or not prompt:
        return 1
    if all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def check_request(
    limits: AdmissionLimits, req: Any, *, prompts: int = 1, api_key: str | None = None
) -> None:
    """Refuse a request over any limit with a 400 naming the flag (and the field)."""
    fields = req.model_fields_set
    # Depth first: every later check walks these values.
    for name in ("response_format", "guided_json", "tools", "tool_choice",
                 "chat_template_kwargs", "logit_bias", "messages"):  # fmt: skip
        if name not in fields:
            continue
        value = getattr(req, name)
        if name == "messages":
            value = [m.tool_calls for m in value if m.tool_calls]
        if json_depth(value, limits.max_json_depth) > limits.max_json_depth:
            raise _refuse(f"{name} is nested too deeply", "--max-json-depth",
                          limits.max_json_depth, name)  # fmt: skip
    best_of = getattr(req, "best_of", None) or 1
    sequences = prompts * max(req.n, best_of, 1)
    if sequences > limits.max_sequences_per_request:
        raise _refuse(
            f"this request asks for {sequences} sequences ({prompts} prompt(s) × n={req.n}"
            f"{f' × best_of={best_of}' if best_of > 1 else ''})",
            "--max-sequences-per-request", limits.max_sequences_per_request,
            "n" if prompts == 1 else "prompt",
        )  # fmt: skip
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise _refuse(f"stop has {len(stop)} strings", "--max-stop-strings",
                      limits.max_stop_strings, "stop")  # fmt: skip
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise _refuse(f"a stop string has {longest} characters", "--max-stop-string-chars",
                      limits.max_stop_string_chars, "stop")  # fmt: skip
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise _refuse(f"stop_token_ids has {len(req.stop_token_ids)} entries",
                      "--max-stop-token-ids", limits.max_stop_token_ids, "stop_token_ids")  # fmt: skip
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise _refuse(f"logit_bias has {len(req.logit_bias)} entries", "--max-logit-bias",
                      limits.max_logit_bias, "logit_bias")  # fmt: skip
    tools = getattr(req, "tools", None)
    if tools and len(tools) > limits.max_tools:
        raise _refuse(f"tools has {len(tools)} entries", "--max-tools", limits.max_tools, "tools")
    for name in ("response_format", "guided_json", "guided_regex", "guided_grammar",
                 "guided_choice", "tools"):  # fmt: skip
        value = getattr(req, name, None)
        if value is None:
            continue
        size = _json_bytes(value)
        if size > limits.max_schema_bytes:
            raise _refuse(f"{name} is {size} bytes", "--max-schema-bytes",
                          limits.max_schema_bytes, name)  # fmt: skip
    check_priority(limits, req.priority, api_key)


def check_priority(limits: AdmissionLimits, priority: int, api_key: str | None) -> None:
    if limits.scheduling_policy == "fcfs":
        if priority != 0:
            raise APIError(
                400,
                "priority is only accepted with --scheduling-policy priority (this server "
                f"runs fcfs); got {priority}",
                param="priority",
            )
        return
    bound = limits.max_priority
    if not -bound <= priority <= bound:
        raise _refuse(f"priority must be in [-{bound}, {bound}], got {priority}",
                      "--max-priority", bound, "priority")  # fmt: skip
    if priority < 0 and not (limits.admin_api_key and api_key == limits.admin_api_key):
        raise APIError(
            400,
            f"priority below 0 (here {priority}) runs ahead of other users' requests and needs "
            "the admin API key (--admin-api-key)",
            param="priority",
            code="priority_not_allowed",
        )


def check_queue(limits: AdmissionLimits, num_waiting: int) -> None:
    """503 when more engine requests wait to be scheduled than --max-queue-len allows."""
    if limits.max_queue_len is not None and num_waiting >= limits.max_queue_len:
        raise APIError(
            503,
            f"the server is overloaded: {num_waiting} requests are waiting "
            f"(--max-queue-len {limits.max_queue_len}); retry later",
            code="queue_full",
        )
