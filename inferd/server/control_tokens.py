"""Message content cannot forge the chat template's control tokens.

A chat prompt is rendered to text and then tokenized with special-token matching on, so that the
template's own `<|im_start|>` / `<|im_end|>` become the control tokens the model was trained on.
Text inside a message that spells one of them would become the same token: a user could close
their turn and open a forged system turn. So before rendering, every control-token spelling in a
message's content is swapped for a sentinel (a private-use character pair around a per-render
nonce the client cannot guess); after rendering, the text around sentinels is tokenized as usual
and each sentinel as the plain text it stood for (special-token matching off). Everything the
template wrote itself stays special. `--allow-control-tokens-in-content` turns this off.

Content without any control-token spelling is rendered and tokenized exactly as before.
"""

from __future__ import annotations

import re
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from inferd.loader.tokenizer import Tokenizer

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer gives them meaning


@dataclass(slots=True)
class _Specials:
    pattern: re.Pattern[str] | None  # any control token's spelling
    plain: HFTokenizer  # the same vocabulary with special-token matching off


_SPECIALS: weakref.WeakKeyDictionary[Tokenizer, _Specials] = weakref.WeakKeyDictionary()


def _specials(tok: Tokenizer) -> _Specials:
    found = _SPECIALS.get(tok)
    if found is None:
        spellings = sorted(
            {s for t in tok.special_token_ids if (s := tok.hf.id_to_token(t))},
            key=len,
            reverse=True,
        )
        pattern = re.compile("|".join(map(re.escape, spellings))) if spellings else None
        plain = HFTokenizer.from_str(tok.hf.to_str())
        plain.encode_special_tokens = True
        found = _SPECIALS[tok] = _Specials(pattern, plain)
    return found


@dataclass(slots=True)
class GuardedMessages:
    """Messages with control-token spellings in their content replaced by sentinels."""

    messages: list[dict[str, Any]]
    nonce: str = ""
    replaced: list[str] = field(default_factory=list)  # sentinel k stood for replaced[k]

    def encode(self, tok: Tokenizer, text: str) -> list[int]:
        """Token ids of `text` (a rendering of `messages`): sentinels as plain text."""
        if not self.replaced:
            return tok.encode(text, add_special_tokens=False)
        plain = _specials(tok).plain
        ids: list[int] = []
        sentinel = re.compile(f"{_OPEN}{self.nonce}(\\d+){_CLOSE}")
        pos = 0
        for m in sentinel.finditer(text):
            ids += tok.encode(text[pos : m.start()], add_special_tokens=False)
            k = int(m.group(1))
            if k < len(self.replaced):
                ids += plain.encode(self.replaced[k], add_special_tokens=False).ids
            pos = m.end()
        ids += tok.encode(text[pos:], add_special_tokens=False)
        return ids


def guard_messages(tok: Tokenizer, messages: list[dict[str, Any]]) -> GuardedMessages:
    """Swap control-token spellings in each message's string content for sentinels."""
    pattern = _specials(tok).pattern
    if pattern is None:
        return GuardedMessages(messages)
    guarded = GuardedMessages([], secrets.token_hex(8))

    def swap(m: re.Match[str]) -> str:
        guarded.replaced.append(m.group(0))
        return f"{_OPEN}{guarded.nonce}{len(guarded.replaced) - 1}{_CLOSE}"

    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and pattern.search(content):
            message = {**message, "content": pattern.sub(swap, content)}
        guarded.messages.append(message)
    return guarded
