"""A request's routing key: its prompt as token ids when the router has the model's tokenizer,
else as text.

The ids are what the worker computes for the same request (chat: the model's template with a
generation prompt, then encoded without special tokens, which the template writes itself), so
an exact-mode lookup (kv_index.py) finds the worker's blocks. Anything the router cannot read
becomes a text key (or an empty one): the worker, not the router, answers malformed fields.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("inferd.router")

Key = tuple[int, ...] | str


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


class RequestKeys:
    """Keys for /v1/completions and /v1/chat/completions bodies (parsed JSON objects)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def completion(self, body: dict) -> Key:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:  # a batch routes by its first prompt
            if all(isinstance(t, int) for t in prompt):
                return tuple(prompt)
            prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return tuple(prompt)
        if not isinstance(prompt, str):
            return ""
        if self.tokenizer is None:
            return prompt
        return tuple(self.tokenizer.encode(prompt))

    def chat(self, body: dict) -> Key:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return ""
        tok = self.tokenizer
        if tok is not None and tok.chat_template:
            try:
                kwargs = {"add_generation_prompt": body.get("add_generation_prompt", True)}
                text = tok.apply_chat_template(messages, tools=body.get("tools"), **kwargs)
                return tuple(tok.encode(text, add_special_tokens=False))
            except Exception:
                logger.debug("chat template failed; routing by text", exc_info=True)
        return "".join(f"{m.get('role', '')}\n{_text_of(m.get('content'))}\n" for m in messages)
