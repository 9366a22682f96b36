"""The engine's side of structured output: compiles off the engine loop under a time limit, gives
each structured sequence its own matcher, builds the token bitmask of a batch and applies it.

Bitmask layout (llguidance's): int32 [R, ceil(V / 32)], bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence as Seq

import llguidance as llg
import numpy as np
import torch

from inferd.structured.backend import GrammarCompiler, GrammarError
from inferd.structured.params import StructuredOutputsParams


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("m",)

    def __init__(self, m: llg.LLMatcher) -> None:
        self.m = m

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self.m.deep_copy())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens → bitmask[row] (a CPU int32 tensor)."""
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is finished (or broken: a token outside
        the mask, which the mask makes impossible unless the grammar itself fails)."""
        if not self.m.consume_token(token):
            return True
        return self.m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    @property
    def error(self) -> str:
        return self.m.get_error()


class StructuredOutputManager:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 timeout: float, workers: int = 2) -> None:  # fmt: skip
        self.compiler = GrammarCompiler(tokenizer_json, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.timeout = timeout
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="inferd-grammar")
        self._inflight: dict[tuple[str, str], cf.Future] = {}
        # One worker that fills step N's masks while step N's forward runs.
        self._mask_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="inferd-mask")

    # ---- compilation (never on the engine loop) ------------------------------------------
    def _future(self, spec: StructuredOutputsParams) -> cf.Future:
        fut = self._inflight.get(spec.key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self.compiler.compile, spec)
            self._inflight[spec.key] = fut
            fut.add_done_callback(lambda f, key=spec.key: self._forget(key, f))
        return fut

    def _forget(self, key: tuple[str, str], fut: cf.Future) -> None:
        if self._inflight.get(key) is fut:
            del self._inflight[key]

    def _timeout_error(self, spec: StructuredOutputsParams) -> GrammarError:
        return GrammarError(
            f"compiling the {spec.kind} grammar took longer than --structured-output-timeout "
            f"({self.timeout:g} s); simplify it"
        )

    def prepare(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` (blocking the caller, not the engine loop) within the time limit."""
        if self.compiler.cached(spec) is not None:
            return
        try:
            self._future(spec).result(timeout=self.timeout)
        except cf.TimeoutError:
            raise self._timeout_error(spec) from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for a new sequence (compiles, bounded by the timeout, if not prepared)."""
        proto = self.compiler.cached(spec)
        if proto is None:
            self.prepare(spec)
            proto = self.compiler.compile(spec)
        return GrammarMatcher(proto.deep_copy())

    # ---- masks --------------------------------------------------------------------------
    def allocate(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers: Seq[GrammarMatcher | None]) -> torch.Tensor | None:
        """The bitmask of a batch (all-ones rows for free sequences), or None if none is structured."""
        if all(m is None for m in matchers):
            return None
        bitmask = self.allocate(len(matchers))
        for row, m in enumerate(matchers):
            if m is not None:
                m.fill(bitmask, row)
        return bitmask

    def fill_async(self, matchers: Seq[GrammarMatcher | None]) -> cf.Future:
        return self._mask_pool.submit(self.fill, list(matchers))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits with the tokens each row's bitmask disallows set to -inf (a new tensor).

    logits: [R, V]; bitmask: int32 [R, ceil(V / 32)] on the CPU. Free rows are all ones there, so
    their logits come out bit-identical. numpy's unpackbits expands the bits: ~0.1 ms at R = 32,
    where shift-and-mask tensor ops take ~50 ms.
    """
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool).to(logits.device)
    return torch.where(allowed, logits, torch.tensor(float("-inf"), device=logits.device))
