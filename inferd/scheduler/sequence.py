"""A sequence: the unit the scheduler runs. A request with n > 1 becomes n sequences after its
prompt is computed once (the children share the prompt's KV blocks)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from typing import Any

import torch

from inferd.sampling.params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(eq=False, slots=True)
class SpecState:
    """A sequence's speculative-decoding state: the drafts proposed to follow its tokens (verified
    in its next step), and the depth policy's record of how it has fared."""

    # Draft tokens, and the draft distributions they were sampled from ([k, vocab]; None: chosen
    # deterministically — the acceptance rule depends on it).
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    # Leaves of a draft tree (greedy sequences only): (depth, token) alternatives to the draft at
    # that depth (1-based), each verified in a row of its own that sees the drafts above it.
    leaves: list[tuple[int, int]] = field(default_factory=list)
    depth: int = 0  # how deep the drafts were drafted
    # The proposer's own expectation of how many of the drafts and leaves are accepted (a ranking
    # proposer's: the sum of their path probabilities), None where it has none.
    expected: float | None = None
    policy_state: Any = None  # the depth policy's per-sequence record (inferd.spec.policy)

    def set(self, token_ids: list[int], probs: torch.Tensor | None = None,
            leaves: list[tuple[int, int]] | None = None,
            depth: int | None = None, expected: float | None = None) -> None:  # fmt: skip
        """`depth`: how deep the proposer drafted (default: the chain's length; a dynamic draft
        tree verifies fewer of its drafts and some runner-ups instead). `expected`: how many of
        the drafts and leaves the proposer expects accepted, if it knows."""
        self.token_ids = token_ids
        self.probs = probs
        self.leaves = leaves or []
        self.depth = len(token_ids) if depth is None else depth
        self.expected = expected

    def clear(self) -> None:
        """No drafts (the policy's record stays)."""
        self.set([])

    def trim(self, k: int) -> None:
        """Keep the first k draft tokens (the step's token budget had no room for the rest)."""
        rows = len(self.token_ids) + len(self.leaves)
        if len(self.token_ids) > k:
            self.token_ids = self.token_ids[:k]
            if self.probs is not None:
                self.probs = self.probs[:k]
        if self.leaves and self.leaves[-1][0] > k:
            self.leaves = [(d, t) for d, t in self.leaves if d <= k]
        self.depth = min(self.depth, len(self.token_ids) + len(self.leaves))
        if len(self.token_ids) + len(self.leaves) < rows:
            self.expected = None  # the proposer's expectation was for the rows it chose


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    index: int  # which of the request's n outputs this is
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache: positions [0, num_computed_tokens).
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_skips: int = 0  # times cache-aware scheduling admitted a later request before this one
    generator: torch.Generator | None = None
    pending_forks: int = 0  # n - 1 until the prompt's first token is sampled, then 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # What the KV connector returned when it finished (`request_finished`), for the client.
    kv_transfer_params: dict | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    # Structured output: the sequence's grammar matcher (inferd.structured.GrammarMatcher).
    matcher: Any = None
    # The text so far and stop strings (inferd.engine.detokenizer.IncrementalDetokenizer).
    detok: Any = None
    spec: SpecState = field(default_factory=lambda: SpecState())  # speculative decoding's
    # The LoRA adapter load it runs under (inferd.lora.LoRAAdapter); None: the base model.
    lora: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority, then arrival (FCFS), then creation order."""
        return (self.priority, self.arrival_time, self.seq_id)

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        return Sequence(
            request_id=self.request_id,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            priority=self.priority,
            arrival_time=self.arrival_time,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            generator=generator,
            logprobs=[] if self.logprobs is not None else None,
            matcher=self.matcher.copy() if self.matcher is not None else None,
            lora=self.lora,
        )
