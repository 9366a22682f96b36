"""Incremental detokenization with stop strings.

Each new token costs O(1) decoding work (tokenizers' `DecodeStream`, which holds back bytes of a
UTF-8 character split across tokens). The stream starts from the prompt's last tokens, so the first
output token reads as it continues the prompt: SentencePiece decoders drop the space that starts a
text ("▁Paris" alone is "Paris"), not the one that follows a prompt (" Paris"). Stop strings are searched only in the tail that the new text
could have completed; when streaming, the last `max(len(stop)) - 1` characters are held back so a
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
    __slots__ = ("_tok", "_stream", "_stops", "_holdback", "_include_stop", "text", "_emitted")

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer.hf
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in prompt_ids[-_CONTEXT_TOKENS:]:  # their text is the prompt's, not output
            self._stream.step(self._tok, token_id)
        self._stops = params.stop_strings
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = params.include_stop_str_in_output
        self.text = ""
        self._emitted = 0  # characters of `text` already handed out as deltas

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string if one now ends the text."""
        piece = self._stream.step(self._tok, token_id)
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
