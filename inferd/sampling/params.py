"""Sampling parameters, shaped and named like vLLM's so scripts port unchanged; validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.structured.params import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    skip_special_tokens: bool = True
    structured: StructuredOutputsParams | None = None  # constrain the output to a grammar
    # The prefix-cache salt: blocks are shared only among requests with the same one (a digest,
    # server/privacy.py; kept out of repr, so out of the request log).
    cache_salt: str | None = field(default=None, repr=False)
    # vLLM's: what a KV connector is asked to do for this request (prefill/decode disaggregation:
    # {"do_remote_decode": true}, or a transfer handle with "do_remote_prefill"; kv/connectors/pd).
    kv_transfer_params: dict | None = field(default=None, repr=False)
    # The LoRA adapter the request runs under (inferd.lora.LoRARequest; None: the base model):
    # set from `LLM.generate(lora_request=...)` or the server's `model` field, and carried with
    # the parameters into the engine process.
    lora_request: Any = field(default=None, repr=False)
    # Filled by validation: the normalized stop strings.
    stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not 0 <= self.temperature < float("inf"):  # written so that NaN fails too
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer below 2^31, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63 - self.n):
            bad(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        self.stop_strings = self._normalize_stop(self.stop)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            bad(f"structured must be a StructuredOutputsParams, got {type(self.structured).__name__}")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
                bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                bad(f"logit_bias must map integer token ids to numbers, got {self.logit_bias!r}")
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    bad(f"logit_bias token id must be >= 0, got {tok}")
                if not -100.0 <= bias <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

    @staticmethod
    def _normalize_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return tuple(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for tok in (self.logit_bias or {}):
            if tok >= vocab_size:
                raise ValueError(f"logit_bias token id {tok} is out of range (vocab size {vocab_size})")
        for tok in self.stop_token_ids or ():
            if tok >= vocab_size:
                raise ValueError(f"stop_token_ids entry {tok} is out of range (vocab size {vocab_size})")
