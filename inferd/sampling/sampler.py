"""Logits → next tokens for a batch of sequences: processors, greedy or random sampling, logprobs.

Rows may repeat (a request with n > 1 samples n children from one prompt's logits). Randomness is
per sequence: a seeded sequence draws from its own generator, so its output does not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.readbacks import HostReadbacks
from inferd.host_to_device import upload
from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.sampling.processors import apply_processors
from inferd.scheduler.sequence import Sequence
from inferd.structured.manager import apply_bitmask

# A sampled token's (logprob, rank, [(token, logprob)] of the top ones).
TokenLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per sequence: the sampled token's TokenLogprob, or None if not asked.
    logprobs: list[TokenLogprob | None]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of 2-D rows: on the CPU in fp32 one C++ loop per row (csrc/layer_ops.h,
    the same index: the first maximum, or the first NaN); ATen's CPU argmax is scalar code, ~90 µs
    for one row of the default model's 49k logits."""
    if x.dim() == 2 and x.is_cpu and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(1) == 1:
        ext = cpu_kernels()
        if ext is not None:
            return ext.argmax_rows(x)
    return x.argmax(dim=-1)


def token_logprob(row: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """`row`: log-softmax of the raw logits (what OpenAI's logprobs report)."""
    lp = row[token].item()
    rank = int((row > lp).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if num_top:
        vals, idx = row.topk(num_top)
        top = list(zip(idx.tolist(), vals.tolist()))
    return lp, rank, top


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus top-p; top_k 0 = off."""
    if logits.dim() == 2 and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        ext = cpu_kernels()
        if ext is not None:  # sorts the nucleus only (csrc/sampling_ops.h); a full sort per row
            # costs 8 ms for one row of 49k logits, 170 ms for 32, more than a decode step
            return ext.top_k_top_p(logits, top_k.long().contiguous(), top_p.float().contiguous())
    return _filter_top_k_top_p_sorted(logits, top_k, top_p)


def _filter_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_filter_top_k_top_p` by sorting every row (any device and dtype)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    remove = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


class Sampler:
    """Sampling with one readback per call (the tokens; `readbacks` counts it), plus those of the
    logprobs asked for."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], readbacks: HostReadbacks | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.readbacks = readbacks or HostReadbacks()

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[Sequence],
        bitmask: torch.Tensor | None = None,
    ) -> SampleResult:
        """logits: [R, V] fp32; seqs[i] samples from logits[rows[i]]. bitmask: the grammar masks,
        int32 [R, ceil(V / 32)] (inferd.structured), applied to structured sequences' rows only."""
        if logits.shape[-1] > self.vocab_size:  # padded vocab rows never get sampled
            logits = logits[:, : self.vocab_size]
        if rows != list(range(len(rows))):
            logits = logits[upload(rows, logits.device)]
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None

        logits = apply_processors(logits, seqs, self.eos_token_ids)
        if bitmask is not None:  # free sequences' rows are all ones: untouched
            logits = apply_bitmask(logits, bitmask[rows] if rows != list(range(len(rows))) else bitmask)
        tokens = argmax_rows(logits)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            index = upload(random_rows, logits.device)
            drawn = self._sample_random(logits.index_select(0, index), [seqs[i] for i in random_rows])
            tokens.index_copy_(0, index, drawn.to(tokens.dtype))
        token_list = self.readbacks.to_host(tokens)

        logprob_out: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if want_logprobs[i]:
                    logprob_out[i] = token_logprob(raw_logprobs[i], token_list[i], seq.params.logprobs)
        return SampleResult(token_list, logprob_out)

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        return draw(sampling_distribution(logits, seqs), seqs)


def sampling_distribution(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k / top-p, then min-p.
    Rows are processed logits of non-greedy sequences (anything with `.params`). Which filters
    run is decided from the parameters on the host: no readback."""
    dev = logits.device
    params = [s.params for s in seqs]
    temps = upload([p.temperature for p in params], dev, logits.dtype)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = upload([p.top_k for p in params], dev)
        top_p = upload([p.top_p for p in params], dev, logits.dtype)
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = upload([p.min_p for p in params], dev, probs.dtype)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # a distribution again (verification needs it)
    return probs


def skip_draws(generator: torch.Generator, n: int) -> None:
    """Advance a seeded sequence's generator past `n` tokens sampled elsewhere (each took one
    uniform in `draw`): PD's decode side continues where the prefill side's first token left it."""
    for _ in range(n):
        torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)


def draw(probs: torch.Tensor, seqs: list) -> torch.Tensor:
    """One token per row of `probs` [R, V] (unnormalized is fine), by inverse CDF: one uniform u
    per row, the first token whose cumulative probability exceeds u times the total. Each seeded
    row draws u from its sequence's own generator: reproducible whatever else is in the batch.
    (Not exponential-race sampling, argmax(p / E): it draws V random numbers per row, and
    PyTorch's CPU `exponential_` spends 38 ms on 32 rows of 49k, as long as the decode step.)
    The uniforms are drawn on `probs`' device (a seeded sequence's generator lives there): no
    readback."""
    dev = probs.device
    u = torch.empty(len(seqs), dtype=torch.float64, device=dev)
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if unseeded:
        u.index_copy_(0, upload(unseeded, dev), torch.rand(len(unseeded), dtype=torch.float64, device=dev))
    for i, s in enumerate(seqs):
        if s.generator is not None:
            u[i : i + 1] = torch.rand(1, generator=s.generator, dtype=torch.float64, device=s.generator.device)
    if probs.dim() == 2 and probs.is_cpu and probs.dtype == torch.float32 and probs.stride(-1) == 1:
        ext = cpu_kernels()
        if ext is not None:
            return ext.sample_rows(probs, u)
    cdf = probs.double().cumsum(dim=-1)
    x = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
