"""What the engine hands back, shaped like vLLM's outputs so scripts written for it port unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.scheduler.sequence import Logprob


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # What the KV connector returned when the request finished (a PD transfer handle), vLLM's.
    kv_transfer_params: dict | None = None


@dataclass(slots=True)
class SequenceDelta:
    """One step's news about one output of a request (for streaming front ends)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
