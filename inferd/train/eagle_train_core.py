"""Training and offline evaluation of the EAGLE-style draft head on the target's hidden states.

Loss (EAGLE, with the chain unrolled as the engine runs it): for chain step j = 1..U drafting from
position t, the head's feature (step 1 reads the target's h_t, step j > 1 the head's own previous
prediction, and the attention sees the chain's own earlier keys: inferd.train.head_levels) is
pulled towards the target's h_{t+j} (smooth-L1) and its logits towards the target's greedy token
after t + j (cross-entropy), weighted by decay^(j-1). Only chains that start at or after the last
prompt position count: drafting never starts inside a prompt.

The cross-entropy runs over the tokens that occur in the data (inputs and greedy labels), not the
whole vocabulary: on the CPU the LM head's [rows, vocabulary] matmul, forward and backward, would be
most of the training time, and tokens the target never produces in the data carry little
signal.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.spec.eagle_head import EagleHead
from inferd.train.eagle_data import HiddenStates
from inferd.train.head_levels import forward_levels


@dataclass(slots=True)
class TrainOptions:
    epochs: float = 3.0
    batch_size: int = 8  # sequences per step
    unroll: int = 3  # chained steps per example (inference chains k = 3..5)
    lr: float = 2e-3  # peak, after a warmup of 5 % of the steps, then cosine decay
    weight_decay: float = 0.1
    ce_weight: float = 0.1  # EAGLE's: the feature regression generalises better than the CE
    # The feature regression's weight; 0: cross-entropy alone (EAGLE-3's loss), for a last stage.
    reg_weight: float = 1.0
    step_decay: float = 0.8
    noise: float = 0.1  # uniform noise on the input hidden state, times its std (EAGLE's 0.1)
    full_vocab_ce: bool = False
    # Share of the rows the cross-entropy reads (a random subset each step): the LM head's matmul,
    # forward and backward, costs several times the whole head's on the CPU.
    ce_rows: float = 0.25
    # The matmuls' precision: "bfloat16" runs the forward under autocast (fp32 weights, optimizer
    # and losses), "auto" does where the hardware computes bf16 natively (AVX512-BF16 / AMX CPUs,
    # CUDA). Matmuls are most of a training step, and native bf16 runs them about twice as fast.
    precision: str = "auto"
    seed: int = 0
    log_every: int = 50


PRECISIONS = ("auto", "float32", "bfloat16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the training forward autocasts to (None: plain fp32) for a `precision` option."""
    from inferd.config import computes_bf16_natively

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision == "bfloat16" or (precision == "auto" and computes_bf16_natively(device)):
        return torch.bfloat16
    return None


def precision_name(dtype: torch.dtype | None) -> str:
    """What `autocast_dtype` resolved to, as the option spells it."""
    return str(dtype or torch.float32).removeprefix("torch.")


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@dataclass(slots=True)
class SeqData:
    """The training sequences: tokens [T], the target's rows [T, H] (or [T, H * (1 + n)] with the
    head's feature layers after the final hidden state; kept in their stored dtype, fp16 from the
    data cache, and made fp32 a batch at a time), its greedy token after each position [T], and
    where each prompt ends."""

    tokens: list[torch.Tensor]
    hidden: list[torch.Tensor]
    greedy: list[torch.Tensor]
    prompt_lens: list[int]

    @property
    def num_positions(self) -> int:
        return sum(len(t) for t in self.tokens)


# Candidates of each row's bf16 scores that `greedy_tokens` rescores in fp32.
GREEDY_CANDIDATES = 8


@torch.no_grad()
def greedy_tokens(
    hidden: torch.Tensor,
    lm_weight: torch.Tensor,
    chunk: int = 1024,
    lm_bf16: torch.Tensor | None = None,
) -> torch.Tensor:
    """argmax of the target's fp32 logits at each row of hidden [N, H] -> [N].

    With `lm_bf16` (lm_weight in bf16, where the hardware computes it natively) each row's
    GREEDY_CANDIDATES best bf16 scores are rescored in fp32 and the best of those is taken: the
    fp32 argmax unless it falls outside them (bf16 rounds each input to ~3 significant digits:
    a logit moves by far less than the gap to an 8th-best one). The whole vocabulary's [N, V]
    matmul over every position of the data is what costs, in every stage of the recipe: in fp32
    it takes a large share of a stage's time on a CPU."""
    out = []
    for h in hidden.split(chunk):
        h = h.float()
        if lm_bf16 is None:
            out.append((h @ lm_weight.T).argmax(-1))
            continue
        cand = (h.bfloat16() @ lm_bf16.T).topk(GREEDY_CANDIDATES, dim=-1).indices  # [n, C]
        exact = torch.einsum("nh,nch->nc", h, lm_weight[cand])
        out.append(cand.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1))
    return torch.cat(out)


def prepare(
    data: HiddenStates, prompt_lens: list[int], lm_weight: torch.Tensor, precision: str = "auto"
) -> SeqData:
    """The training sequences of length >= 2 with the target's greedy token after each position
    (found from bf16 scores where `precision` resolves to bf16, see `greedy_tokens`)."""
    keep = [i for i, t in enumerate(data.tokens) if len(t) >= 2]
    if not keep:
        raise ValueError("no sequence has 2 tokens")
    lm_bf16 = lm_weight.bfloat16() if autocast_dtype(precision, lm_weight.device) else None
    h = lm_weight.shape[1]  # the final hidden state: the rows' first H values
    return SeqData(
        [data.tokens[i] for i in keep],
        [data.hidden[i] for i in keep],
        [greedy_tokens(data.hidden[i][:, :h], lm_weight, lm_bf16=lm_bf16) for i in keep],
        [prompt_lens[i] for i in keep],
    )


def pad_batch(seqs: list[torch.Tensor], fill: float = 0) -> torch.Tensor:
    """[B, T_max, ...] from tensors [T_i, ...], padded with `fill`."""
    longest = max(len(s) for s in seqs)
    out = seqs[0].new_full((len(seqs), longest, *seqs[0].shape[1:]), fill)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def head_loss(
    head: EagleHead,
    data: SeqData,
    idx: list[int],  # sequences of the batch
    embed_fn: Callable[[torch.Tensor], torch.Tensor],
    lm_weight: torch.Tensor,  # [V', H] rows of the LM head the cross-entropy runs over
    vocab_map: torch.Tensor | None,  # [V] token -> row of lm_weight (None: full vocabulary)
    opts: TrainOptions,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    clean = pad_batch([data.hidden[i] for i in idx]).float()
    hidden = clean
    tokens = pad_batch([data.tokens[i] for i in idx])
    greedy = pad_batch([data.greedy[i] for i in idx])
    lengths = torch.tensor([len(data.tokens[i]) for i in idx])
    prompt = torch.tensor([data.prompt_lens[i] for i in idx])
    h = head.hidden_size
    if opts.noise > 0:
        # Each H-wide part (the final hidden state, each feature layer's) by its own spread.
        parts = hidden.unflatten(-1, (-1, h))
        u = torch.rand(parts.shape, generator=generator) * 2 - 1
        spread = parts.transpose(0, 2).flatten(1).std(dim=1)  # [parts]
        hidden = (parts + u * (opts.noise * spread[:, None])).flatten(-2)
    feats = forward_levels(head, hidden, tokens, lengths, opts.unroll, embed_fn)
    t1 = hidden.shape[1] - 1
    pos = torch.arange(t1)
    labels = greedy[:, 1:]
    target = clean[:, 1:, :h]  # noise-free final hidden states
    if vocab_map is not None:
        labels = vocab_map[labels]
    total = hidden.new_zeros(())
    stats: dict[str, float] = {}
    weight_sum = 0.0
    for level, feature in enumerate(feats):
        # Row p of this level: a chain from t = p - level, predicting h_{p+1} and the token after.
        start = pos[None, :] - level
        ok = (start >= 0) & (start >= prompt[:, None] - 1) & (pos[None, :] + 1 < lengths[:, None])
        f, tgt, lab = feature[ok], target[ok], labels[ok]
        reg = F.smooth_l1_loss(f, tgt)
        if opts.ce_rows < 1.0:
            pick = torch.rand(len(f), generator=generator) < opts.ce_rows
            f, lab = f[pick], lab[pick]
        logits = f @ lm_weight.T
        ce = F.cross_entropy(logits, lab)
        w = opts.step_decay**level
        total = total + w * (opts.reg_weight * reg + opts.ce_weight * ce)
        weight_sum += w
        stats[f"acc{level + 1}"] = (logits.argmax(-1) == lab).float().mean().item()
        stats[f"ce{level + 1}"] = ce.item()
        stats[f"reg{level + 1}"] = reg.item()
    return total / weight_sum, stats


def train_head(
    head: EagleHead,
    data: SeqData,
    embed_fn: Callable[[torch.Tensor], torch.Tensor],
    lm_weight: torch.Tensor,  # [V, H] the target's full LM head weight (fp32)
    opts: TrainOptions,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train `head` in place with AdamW (warmup, cosine decay); returns the loss of every step."""
    g = torch.Generator().manual_seed(opts.seed)
    device = head.out_norm.weight.device
    amp = autocast_dtype(opts.precision, device)
    vocab_map = None
    if not opts.full_vocab_ce:
        used = torch.unique(torch.cat(data.tokens + data.greedy))
        vocab_map = torch.full((lm_weight.shape[0],), -1, dtype=torch.long)
        vocab_map[used] = torch.arange(len(used))
        lm_weight = lm_weight[used]
    lm_weight = lm_weight.detach()
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    n = len(data.tokens)
    per_epoch = math.ceil(n / opts.batch_size)
    total_steps = max(1, round(per_epoch * opts.epochs))
    warmup = max(1, total_steps // 20)
    losses: list[float] = []
    log(f"{total_steps} steps, matmuls in {precision_name(amp)}")
    t0 = time.perf_counter()
    order: list[int] = []
    for step in range(total_steps):
        if len(order) < opts.batch_size:  # a new pass over the sequences in a fresh order
            order += torch.randperm(n, generator=g).tolist()
        idx, order = order[: opts.batch_size], order[opts.batch_size :]
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in optim.param_groups:
            group["lr"] = opts.lr * scale
        with _autocast(amp, device), warnings.catch_warnings():
            # Autocast hands the norms bf16 inputs with their fp32 weights: ATen's unfused
            # rms_norm then, which it warns about every call.
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            loss, stats = head_loss(head, data, idx, embed_fn, lm_weight, vocab_map, opts, g)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        losses.append(loss.item())
        if opts.log_every and (step % opts.log_every == 0 or step == total_steps - 1):
            accs = " ".join(f"{stats[f'acc{j}']:.2f}" for j in range(1, opts.unroll + 1))
            log(
                f"step {step + 1}/{total_steps} loss {loss.item():.4f} top-1 per step {accs} "
                f"({time.perf_counter() - t0:.0f} s)"
            )
    head.eval()
    return losses


# ---- offline acceptance --------------------------------------------------------------------------
def leading_matches(drafts: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """drafts, reference [P, K] -> [P]: how many drafted tokens match, counted from the first until
    the first mismatch (what verification at temperature 0 accepts)."""
    same = (drafts == reference).long()
    return same.cumprod(dim=1).sum(dim=1)


def verification_steps(accepted: list[int], start: int, length: int, k: int) -> list[int]:
    """Tokens emitted by each verification step along one sequence of `length` tokens.

    accepted[t] = drafts that would be accepted when drafting from position t (hidden h_t and
    token t + 1 known). Verification from t emits the accepted drafts plus one bonus token, so the
    next step drafts from t + emitted. The first draft comes from `start` (the last prompt
    position; the prefill emitted token start + 1). Stops when the sequence's tokens run out."""
    emitted = []
    t = start
    while length - t - 2 > 0:
        n = min(min(accepted[t], k) + 1, length - t - 2)
        emitted.append(n)
        t += n
    return emitted


@torch.no_grad()
def chain_drafts(
    head: EagleHead, tokens: torch.Tensor, hidden: torch.Tensor, k: int
) -> torch.Tensor:
    """drafts[t, j] [T - 1, k]: the j + 1-th token a chain drafting from position t proposes, as
    long as the chain's earlier drafts were right (after a wrong one, the row is meaningless; the
    acceptance never reads it). The head's bound target embeds and scores, as in the engine."""
    device = head.target.norm.weight.device
    feats = forward_levels(
        head,
        hidden[None].to(device),
        tokens[None].to(device),
        torch.tensor([len(tokens)], device=device),
        k,
    )
    t1 = len(tokens) - 1
    out = torch.full((t1, k), -1, dtype=torch.long)
    for level, f in enumerate(feats):
        # level l at position p drafts the (l + 1)-th token of the chain from t = p - l.
        picked = head.greedy(f[0]).cpu()
        out[: t1 - level, level] = picked[level:]
    return out


@torch.no_grad()
def measure_acceptance(
    head: EagleHead | None,
    data: HiddenStates,
    starts: list[int],
    ks: tuple[int, ...] = (3, 5),
    drafts_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Mean acceptance length (accepted drafts + 1 bonus token per verification step) at
    temperature 0 along each sequence, which must be the target's greedy continuation from
    `starts[i]` (the last prompt position) on. Also the per-position mean (every start drafted).

    Drafting uses the head's bound target (its embedding and LM head, the draft vocabulary when
    set): what the engine runs. `drafts_fn(tokens, hidden, k)` -> [T - 1, k] drafts another
    head's way (as `chain_drafts`), instead of `head`'s chains."""
    kmax = max(ks)
    if drafts_fn is None:
        drafts_fn = lambda tokens, hidden, k: chain_drafts(head, tokens, hidden, k)
    result: dict[str, float] = {}
    emitted: dict[int, list[int]] = {k: [] for k in ks}
    per_pos: list[torch.Tensor] = []
    for tokens, hidden, start in zip(data.tokens, data.hidden, starts):
        n = len(tokens)
        if n - start - 2 <= 0:
            continue
        drafts = drafts_fn(tokens, hidden.float(), kmax)
        pos = torch.arange(start, n - 1)  # positions with a known next token
        # reference[p, j] = the token drafted j + 1 steps from p should equal; -1 past the end.
        ref_idx = pos[:, None] + 2 + torch.arange(kmax)[None, :]
        padded = torch.cat([tokens, tokens.new_full((kmax + 2,), -1)])
        acc = leading_matches(drafts[pos], padded[ref_idx])
        per_pos.append(acc)
        full = [0] * start + acc.tolist()
        for k in ks:
            emitted[k].extend(verification_steps(full, start, n, k))
    if not per_pos:
        raise ValueError("no sequence has tokens to draft after its prompt")
    acc = torch.cat(per_pos)
    for k in ks:
        result[f"k{k}_acceptance_length"] = sum(emitted[k]) / len(emitted[k])
        result[f"k{k}_per_position"] = (acc.clamp(max=k) + 1).float().mean().item()
        result[f"k{k}_steps"] = len(emitted[k])
    return result
