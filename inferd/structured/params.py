"""What a request asks its output to match: exactly one of a JSON schema, any JSON object, a regex,
a list of choices or a grammar (Lark / EBNF / GBNF). Named like vLLM's `StructuredOutputsParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, EBNF or GBNF (llama.cpp) text
    json_object: bool = False  # any JSON object
    # Filled by validation: the cache key, (kind, canonical text).
    key: tuple[str, str] = field(default=("", ""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar or "
                f"json_object; got {given or 'none'}"
            )
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (json.JSONDecodeError, RecursionError) as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            text = json.dumps(
                schema, separators=(",", ":")
            )  # key order matters: it is the output order
        elif kind == "choice":
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{kind} must be a non-empty string")
        object.__setattr__(self, "key", (kind, text))

    @property
    def kind(self) -> str:
        return self.key[0]
