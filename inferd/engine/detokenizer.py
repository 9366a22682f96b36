"""Incremental detokenization with stop strings.

Each new token costs O(1) decoding work (tokenizers' `DecodeStream`, which holds back bytes of a
UTF-8 character split across tokens). The stream starts from the prompt's last tokens, so the first
output token reads as it continues the prompt: SentencePiece decoders drop the space that starts a
text ("▁Paris" alone is "Paris"), not the one that follows a prompt (" Paris"). Stop strings are
searched only in the tail that the new text could have completed; when streaming, the last `max(len(stop)) - 1` characters are held back so a
stop string split across tokens never reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from inferd.loader.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams

# Prompt tokens the stream starts from: enough for a space marker and a split UTF-8 character.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    __slots__ = (
        "_context",
        "_emitted",
        "_holdback",
        "_ids",
        "_include_stop",
        "_skip",
        "_stops",
        "_stream",
        "_tok",
        "text",
    )  # fmt: skip

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer.hf
        self._skip = params.skip_special_tokens
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])  # their text is the prompt's
        self._ids: list[int] = []  # the output's tokens
        self._stream = self._primed(self._context)
        self._stops = params.stop_strings
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = params.include_stop_str_in_output
        self.text = ""
        self._emitted = 0  # characters of `text` already handed out as deltas

    def _primed(self, ids: list[int]) -> DecodeStream:
        """A stream whose next token's text continues that of `ids`."""
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token_id in ids:
            try:
                stream.step(self._tok, token_id)
            except Exception:  # noqa: BLE001 — see _restart; the context only shapes what follows
                stream = DecodeStream(skip_special_tokens=self._skip)
        return stream

    def _restart(self) -> str:
        """The stream refused a token that changes text it already gave (byte-fallback bytes that
        only now form a character, or no longer do: a model can emit any byte sequence). What was
        given stays (it may differ from what the output now decodes to, in characters that became
        or stopped being U+FFFD); the new text is what the whole output decodes to beyond its
        length, and a new stream goes on from this token."""
        skip = self._skip
        context = self._tok.decode(self._context, skip_special_tokens=skip)
        whole = self._tok.decode(self._context + self._ids, skip_special_tokens=skip)
        if whole.startswith(context):
            whole = whole[len(context) :]
        else:
            whole = self._tok.decode(self._ids, skip_special_tokens=skip)
        self._stream = self._primed(self._ids[-1:])
        return whole[len(self.text) :]

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string if one now ends the text."""
        self._ids.append(token_id)
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception:  # noqa: BLE001 — tokenizers raises a bare Exception for a changed prefix
            piece = self._restart()
        if not piece:
            return None
        start = max(0, len(self.text) - self._holdback)
        self.text += piece
        for stop in self._stops:
            pos = self.text.find(stop, start)
            if pos != -1:
                self.text = self.text[: pos + len(stop) if self._include_stop else pos]
                return stop
        return None

    def delta(self, finished: bool) -> str:
        """New text since the last call; while running, keep back what may start a stop string."""
        end = len(self.text)
        if self._stops and not finished:
            end = max(self._emitted, end - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
