"""Training and offline evaluation of the EAGLE-style draft head on the target's hidden states.

Loss (EAGLE): for unrolled step j = 1..U from position t, the head's feature f_j (step 1 reads the
target's h_t, step j > 1 reads the head's own f_{j-1}: what chaining does at inference) is pulled
towards the target's h_{t+j} (smooth-L1) and its logits towards the target's greedy token after
t + j (cross-entropy), weighted by decay^(j-1).

The cross-entropy runs over the tokens that occur in the data (inputs and greedy labels), not the
whole vocabulary: on the CPU the LM head's [rows, 49152] matmul, forward and backward, would be
most of the training time, and tokens the target never produces here carry little signal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.spec.eagle_data import HiddenStates
from inferd.spec.eagle_head import EagleHead


@dataclass(slots=True)
class TrainOptions:
    epochs: float = 2.0
    batch_size: int = 256
    unroll: int = 3  # chained steps per example (inference chains k = 3..5)
    lr: float = 2e-3
    # Regularisation matters more than capacity here: ~50k tokens of data, and a head that learns
    # them by heart drafts badly on new prompts (measured: ce_weight 0.1 > 0.5 > 2.0).
    weight_decay: float = 0.1
    ce_weight: float = 0.1  # EAGLE's: the feature regression generalises better than the CE
    step_decay: float = 0.8
    noise: float = 0.1  # uniform noise on the input hidden state, times its std (EAGLE's 0.1)
    full_vocab_ce: bool = False
    seed: int = 0
    log_every: int = 50


@dataclass(slots=True)
class FlatData:
    """All sequences concatenated: position i has hidden[i], tokens[i], and greedy[i] = the
    target's argmax token after position i. `starts` are the positions an example may start at
    (its next `unroll` positions lie in the same sequence)."""

    hidden: torch.Tensor  # [N, H]
    tokens: torch.Tensor  # [N]
    greedy: torch.Tensor  # [N]
    starts: torch.Tensor  # [M]


@torch.no_grad()
def greedy_tokens(hidden: torch.Tensor, lm_weight: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax of the target's logits at each row of hidden [N, H] -> [N]."""
    return torch.cat([(h @ lm_weight.T).argmax(-1) for h in hidden.split(chunk)])


def flatten(data: HiddenStates, lm_weight: torch.Tensor, unroll: int) -> FlatData:
    hidden = torch.cat(data.hidden)
    tokens = torch.cat(data.tokens)
    starts, offset = [], 0
    for t in data.tokens:
        n = len(t)
        # position p reads tokens[p + 1 .. p + unroll] and hidden[p + 1 .. p + unroll]
        if n > unroll:
            starts.append(torch.arange(offset, offset + n - unroll))
        offset += n
    if not starts:
        raise ValueError(f"no sequence is longer than unroll={unroll} tokens")
    return FlatData(hidden, tokens, greedy_tokens(hidden, lm_weight), torch.cat(starts))


def head_loss(
    head: EagleHead,
    data: FlatData,
    idx: torch.Tensor,  # [B] example start positions
    embed_fn: Callable[[torch.Tensor], torch.Tensor],
    lm_weight: torch.Tensor,  # [V', H] rows of the LM head the cross-entropy runs over
    vocab_map: torch.Tensor | None,  # [V] token -> row of lm_weight (None: full vocabulary)
    opts: TrainOptions,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    feature = data.hidden[idx]
    if opts.noise > 0:
        u = torch.rand(feature.shape, generator=generator) * 2 - 1
        feature = feature + u * (opts.noise * feature.std())
    total = feature.new_zeros(())
    stats: dict[str, float] = {}
    weight_sum = 0.0
    for j in range(1, opts.unroll + 1):
        feature = head(feature, data.tokens[idx + j], embed_fn)
        target = data.hidden[idx + j]
        labels = data.greedy[idx + j]
        if vocab_map is not None:
            labels = vocab_map[labels]
        logits = feature @ lm_weight.T
        reg = F.smooth_l1_loss(feature, target)
        ce = F.cross_entropy(logits, labels)
        w = opts.step_decay ** (j - 1)
        total = total + w * (reg + opts.ce_weight * ce)
        weight_sum += w
        stats[f"acc{j}"] = (logits.argmax(-1) == labels).float().mean().item()
        stats[f"ce{j}"] = ce.item()
        stats[f"reg{j}"] = reg.item()
    return total / weight_sum, stats


def train_head(
    head: EagleHead,
    data: FlatData,
    embed_fn: Callable[[torch.Tensor], torch.Tensor],
    lm_weight: torch.Tensor,  # [V, H] the target's full LM head weight (fp32)
    opts: TrainOptions,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train `head` in place with AdamW (warmup, cosine decay); returns the loss of every step."""
    g = torch.Generator().manual_seed(opts.seed)
    vocab_map = None
    if not opts.full_vocab_ce:
        used = torch.unique(torch.cat([data.tokens, data.greedy]))
        vocab_map = torch.full((lm_weight.shape[0],), -1, dtype=torch.long)
        vocab_map[used] = torch.arange(len(used))
        lm_weight = lm_weight[used]
    lm_weight = lm_weight.detach()
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    per_epoch = math.ceil(len(data.starts) / opts.batch_size)
    total_steps = max(1, round(per_epoch * opts.epochs))
    warmup = max(1, total_steps // 20)
    losses: list[float] = []
    t0 = time.perf_counter()
    order = torch.empty(0, dtype=torch.long)
    for step in range(total_steps):
        if len(order) < opts.batch_size:  # a new pass over the examples in a fresh order
            order = torch.cat([order, data.starts[torch.randperm(len(data.starts), generator=g)]])
        idx, order = order[: opts.batch_size], order[opts.batch_size :]
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in optim.param_groups:
            group["lr"] = opts.lr * scale
        loss, stats = head_loss(head, data, idx, embed_fn, lm_weight, vocab_map, opts, g)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        losses.append(loss.item())
        if opts.log_every and (step % opts.log_every == 0 or step == total_steps - 1):
            accs = " ".join(f"{stats[f'acc{j}']:.2f}" for j in range(1, opts.unroll + 1))
            log(f"step {step + 1}/{total_steps} loss {loss.item():.4f} top-1 per step {accs} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
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
def measure_acceptance(
    head: EagleHead,
    data: HiddenStates,
    starts: list[int],
    ks: tuple[int, ...] = (3, 5),
    max_rows: int = 512,
) -> dict[str, float]:
    """Mean acceptance length (accepted drafts + 1 bonus token per verification step) at
    temperature 0 along each sequence, which must be the target's greedy continuation from
    `starts[i]` (the last prompt position) on. Also the per-position mean (every start drafted).

    Drafting uses the head's bound target (its embedding and LM head): what the engine runs."""
    kmax = max(ks)
    result: dict[str, float] = {}
    emitted: dict[int, list[int]] = {k: [] for k in ks}
    per_pos: list[torch.Tensor] = []
    for tokens, hidden, start in zip(data.tokens, data.hidden, starts):
        n = len(tokens)
        if n - start - 2 <= 0:
            continue
        pos = torch.arange(start, n - 1)  # positions with a known next token
        # reference[p, j] = the token drafted j + 1 steps from p should equal; -1 past the end.
        ref_idx = pos[:, None] + 2 + torch.arange(kmax)[None, :]
        padded = torch.cat([tokens, tokens.new_full((kmax + 2,), -1)])
        reference = padded[ref_idx]
        ref_device = head.target.norm.weight.device
        drafts = torch.cat([
            head.draft(hidden[p].to(ref_device), tokens[p + 1].to(ref_device), kmax)[0].cpu()
            for p in pos.split(max_rows)
        ])  # fmt: skip
        acc = leading_matches(drafts, reference)
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
