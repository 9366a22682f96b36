"""The engine's one record of a request: what was asked, its sequences (n of them once the prompt
has sampled), and its timing. Everything else per request lives on its sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inferd.sampling.params import SamplingParams
from inferd.scheduler.sequence import Sequence


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad parameters); other requests are unaffected."""


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)  # the parent first, then forked children

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.detok.text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(self.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.finished, self.metrics, self.seqs[0].kv_transfer_params)  # fmt: skip
