"""When a sequence stops: end of sequence, a stop token or string, a complete grammar, or a length
limit. One place decides, for sampled and verified tokens alike."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.scheduler.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StopCriteria:
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def append(self, seq: Sequence, token: int) -> None:
        """Append `token` to `seq` (its text, its grammar) and set `seq.finish_reason` (and
        `stop_reason`) if it ends the sequence. `min_tokens` holds back every stop but the
        grammar's and the length limits."""
        p = seq.params
        seq.token_ids.append(token)
        can_stop = seq.num_output_tokens >= p.min_tokens
        eos = can_stop and not p.ignore_eos and token in self.eos_token_ids
        # The EOS that ends the text is not part of it (as in vLLM; it shows when special tokens
        # are kept, as for tool calls whose marker is one).
        stop_str = seq.detok.add_token(token) if seq.detok is not None and not eos else None
        grammar_done = seq.matcher is not None and seq.matcher.advance(token)
        if eos:
            seq.finish_reason = "stop"
        elif can_stop and p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif can_stop and stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif grammar_done:  # the grammar is complete: nothing but EOS could follow
            seq.finish_reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
