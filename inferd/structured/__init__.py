"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled by llguidance, per-sequence
matchers, token bitmasks applied to logits rows, and OpenAI tool calling on top of them."""

from inferd.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
