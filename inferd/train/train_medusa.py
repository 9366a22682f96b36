"""Train Medusa heads (inferd.spec.medusa_head) for a target model by self-distillation, then
measure their acceptance length on held-out chat prompts.

    python -m inferd.train.train_medusa [--model M] [--out DIR] [--num-heads K] [--num-prompts N]
                                        [--epochs E] [--max-steps S] ...

1. the target answers chat instructions and gives its hidden state at every position: the EAGLE
   recipe's data pipeline and cache (inferd.train.train_eagle `distill`, no feature layers);
2. Medusa-1 (the target frozen): head d at position t learns the target's greedy token after
   t + d (its argmax there, given the text so far: what verification accepts), by cross-entropy
   over the draft vocabulary (the tokens the responses use most, which is all the engine's heads
   score), head d's loss weighted 0.8^(d-1) as in Medusa. Rows are positions from the last prompt
   position on, drawn at random across sequences;
3. the heads are saved to DIR (default $INFERD_CACHE_DIR/medusa/<model name>) with the draft
   vocabulary, reloaded as the engine loads them (int4) on the engine's own target, and their
   greedy chains' acceptance length is measured along the target's greedy answers.
The last line printed is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from inferd.loader import load_model
from inferd.loader.default_model import cache_dir
from inferd.models import build_model
from inferd.spec import draft_vocab
from inferd.spec.eagle_io import CONFIG_FILE, WEIGHTS_FILE
from inferd.spec.medusa_head import MedusaHead
from inferd.train.data_args import add_data_args, parse_with_threads
from inferd.train.draft_vocab import rank_tokens
from inferd.train.eagle_train_core import (
    PRECISIONS,
    SeqData,
    autocast_dtype,
    measure_acceptance,
    precision_name,
    prepare,
)
from inferd.train.train_eagle import EagleRecipe, distill


@dataclass(slots=True)
class MedusaOptions:
    num_heads: int = 4  # K: drafts per step at most
    epochs: float = 2.0  # passes over the training rows
    max_steps: int | None = None  # stop earlier (a short run)
    batch_rows: int = 512  # positions per step
    lr: float = 1e-3  # peak, after a warmup of 5 % of the steps, then cosine decay
    weight_decay: float = 0.0
    head_decay: float = 0.8  # head d's loss weight: head_decay^(d-1)
    precision: str = "auto"  # as train_eagle's: bf16 autocast where native, else fp32
    seed: int = 0
    log_every: int = 50


@dataclass(slots=True)
class MedusaRecipe:
    model: str | None = None  # GGUF / HF dir; None: the default model
    out: str | None = None
    quantization: str = "auto"  # of the target generating the data (and serving later)
    num_prompts: int = 1024  # template instructions
    num_questions: int = 512  # free-form questions the target writes itself
    eval_prompts: int = 16
    max_tokens: int = 160
    draft_vocab_size: int = draft_vocab.DEFAULT_SIZE  # 0: the whole vocabulary
    data_cache: bool = True
    data_seed: int = 0
    train: MedusaOptions = field(default_factory=MedusaOptions)


def _log(msg: str) -> None:
    print(f"train_medusa: {msg}", file=sys.stderr, flush=True)


def training_rows(data: SeqData, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows heads learn from: hidden [N, H] (stored dtype) at every position t from the last
    prompt position on, and labels [N, K]: the target's greedy token after t + d for head d, -1
    past the sequence's end."""
    hidden, labels = [], []
    for tokens, h, greedy, n in zip(data.tokens, data.hidden, data.greedy, data.prompt_lens):
        t = torch.arange(n - 1, len(tokens) - 1)
        if len(t) == 0:
            continue
        at = t[:, None] + torch.arange(1, num_heads + 1)[None, :]  # [n, K]: t + d
        ok = at < len(tokens)
        labels.append(torch.where(ok, greedy[at.clamp(max=len(tokens) - 1)], -1))
        hidden.append(h[t])
    if not hidden:
        raise ValueError("no sequence has a response to learn from")
    return torch.cat(hidden), torch.cat(labels)


def train_heads(head: MedusaHead, hidden: torch.Tensor, labels: torch.Tensor, lm_rows: torch.Tensor,
                vocab_ids: torch.Tensor, opts: MedusaOptions,
                log: Any = _log) -> list[float]:  # fmt: skip
    """Train `head` in place (AdamW, warmup then cosine decay) on rows hidden [N, H] with labels
    [N, K] (token ids, -1: none), scoring over vocab_ids' rows lm_rows [V', H]; labels outside
    vocab_ids are skipped (the head cannot draft them). Returns every step's loss."""
    g = torch.Generator().manual_seed(opts.seed)
    torch.manual_seed(opts.seed)
    vocab_map = torch.full((head.vocab_size + 1,), -1, dtype=torch.long)  # the last: "none"
    vocab_map[vocab_ids] = torch.arange(len(vocab_ids))
    targets = vocab_map[torch.where(labels < 0, head.vocab_size, labels)]  # [N, K], -1 ignored
    weights = [opts.head_decay**d for d in range(head.num_heads)]
    n = len(hidden)
    steps = max(1, round(opts.epochs * n / opts.batch_rows))
    if opts.max_steps is not None:
        steps = min(steps, opts.max_steps)
    warmup = max(1, steps // 20)
    amp = autocast_dtype(opts.precision, hidden.device)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    log(f"{steps} steps of {opts.batch_rows} rows ({n} rows), matmuls in {precision_name(amp)}")
    head.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, n, (min(opts.batch_rows, n),), generator=g)
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optim.param_groups:
            group["lr"] = opts.lr * scale
        with torch.autocast(
            hidden.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None
        ):
            logits = head(hidden[idx].float()) @ lm_rows.T  # [B, K, V']
        lab = targets[idx]
        ces = [F.cross_entropy(logits[:, d].float(), lab[:, d], ignore_index=-1)
               if (lab[:, d] >= 0).any() else logits.new_zeros(()) for d in range(head.num_heads)]  # fmt: skip
        loss = sum(w * ce for w, ce in zip(weights, ces)) / sum(weights)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        losses.append(loss.item())
        if opts.log_every and (step % opts.log_every == 0 or step == steps - 1):
            with torch.no_grad():
                ok = lab >= 0
                hits = (logits.argmax(-1) == lab) & ok
                accs = " ".join(f"{(hits[:, d].sum() / ok[:, d].sum().clamp(min=1)).item():.2f}"
                                for d in range(head.num_heads))  # fmt: skip
            log(f"step {step + 1}/{steps} loss {loss.item():.4f} top-1 per head {accs} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    head.eval()
    return losses


def medusa_drafts(head: MedusaHead) -> Any:
    """`measure_acceptance`'s drafts_fn: at each position t, head d's top token is the draft at
    depth d (no chain: every head reads h_t)."""

    def drafts(tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        rows = hidden[:-1].to(head.weight.device)
        ids, _ = head.top(rows, 1)  # [T - 1, K, 1]
        return ids[:, :k, 0].cpu()

    return drafts


def default_out_dir(model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-") or "model"
    return cache_dir() / "medusa" / slug


def train_medusa(recipe: MedusaRecipe) -> dict[str, Any]:
    """Run the whole recipe; returns the report (also written as DIR/train_report.json)."""
    from inferd.loader import DEFAULT_MODEL_NAME

    times: dict[str, float] = {}
    cpu0, t_all = time.process_time(), time.perf_counter()
    loaded = load_model(recipe.model, quantization=recipe.quantization, verbose=False)
    name = DEFAULT_MODEL_NAME if recipe.model is None else Path(loaded.source).stem
    out = Path(recipe.out) if recipe.out else default_out_dir(name)
    data_recipe = EagleRecipe(model=recipe.model, quantization=recipe.quantization,
                              num_prompts=recipe.num_prompts, num_questions=recipe.num_questions,
                              eval_prompts=recipe.eval_prompts, max_tokens=recipe.max_tokens,
                              data_cache=recipe.data_cache, feature_layers=(),
                              data_seed=recipe.data_seed, progress=True)  # fmt: skip
    data, served = distill(data_recipe, loaded, times)

    t0 = time.perf_counter()
    longest = max(map(len, data.train.tokens + data.eval.tokens))
    fp32 = build_model(loaded.config, loaded.weights, max_positions=longest + 1,
                       dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    lm_weight = fp32.lm_head.weight.detach()  # [V, H]
    seqs = prepare(data.train, data.train_prompt_lens, lm_weight, recipe.train.precision)
    vocab = loaded.config.vocab_size
    size = recipe.draft_vocab_size if 0 < recipe.draft_vocab_size < vocab else vocab
    responses = [s[n:].tolist() for s, n in zip(data.train.tokens, data.train_prompt_lens)]
    vocab_ids = rank_tokens(responses, vocab, size)
    hidden, labels = training_rows(seqs, recipe.train.num_heads)
    head = MedusaHead.for_target(fp32, recipe.train.num_heads)
    _log(f"training {head.num_heads} heads ({sum(p.numel() for p in head.parameters()) / 1e6:.2f} "
         f"M parameters) on {len(seqs.tokens)} sequences")  # fmt: skip
    times["prepare_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    losses = train_heads(head, hidden, labels, lm_weight[vocab_ids], vocab_ids, recipe.train)
    times["train_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    head.requires_grad_(False).save(out)
    if size < vocab:
        draft_vocab.save(out, vocab_ids)
    engine_head = MedusaHead.load(out, served, quantize=True)  # as the engine drafts
    ks = tuple(sorted({min(3, head.num_heads), head.num_heads}))
    starts = [n - 1 for n in data.eval_prompt_lens]
    acceptance = measure_acceptance(
        None, data.eval, starts, ks, drafts_fn=medusa_drafts(engine_head)
    )
    times["eval_s"] = time.perf_counter() - t0
    times["total_s"] = time.perf_counter() - t_all
    times["cpu_s"] = time.process_time() - cpu0  # all threads: wall time mostly measures the load
    report = {
        "model": loaded.source,
        "out": str(out),
        "num_heads": head.num_heads,
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "size_bytes": sum((out / f).stat().st_size for f in (WEIGHTS_FILE, CONFIG_FILE)),
        "train_sequences": len(seqs.tokens),
        "train_rows": len(hidden),
        "train_steps": len(losses),
        "options": asdict(recipe.train),
        "training_matmuls": precision_name(autocast_dtype(recipe.train.precision, hidden.device)),
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "acceptance": acceptance,
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    r, t = MedusaRecipe(), MedusaOptions()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(p, r, "medusa")
    p.add_argument("--draft-vocab-size", type=int, default=r.draft_vocab_size,
                   help="the tokens the heads score (0: the whole vocabulary)")  # fmt: skip
    p.add_argument("--num-heads", type=int, default=t.num_heads)
    p.add_argument("--epochs", type=float, default=t.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--batch-rows", type=int, default=t.batch_rows)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--precision", default=t.precision, choices=PRECISIONS)
    p.add_argument("--seed", type=int, default=t.seed, help="the training's seed")
    a = parse_with_threads(p, argv)
    opts = MedusaOptions(num_heads=a.num_heads, epochs=a.epochs, max_steps=a.max_steps,
                         batch_rows=a.batch_rows, lr=a.lr, precision=a.precision, seed=a.seed)  # fmt: skip
    recipe = MedusaRecipe(model=a.model, out=a.out, quantization=a.quantization,
                          num_prompts=a.num_prompts, num_questions=a.num_questions,
                          eval_prompts=a.eval_prompts, max_tokens=a.max_tokens,
                          draft_vocab_size=a.draft_vocab_size, data_cache=not a.no_data_cache,
                          data_seed=a.data_seed, train=opts)  # fmt: skip
    report = train_medusa(recipe)
    acc, secs = report["acceptance"], report["seconds"]
    print(f"saved {report['out']} ({report['size_bytes'] / 2**20:.1f} MiB) after "
          f"{report['train_steps']} steps in {secs['total_s']:.0f} s ({secs['cpu_s']:.0f} CPU s)")  # fmt: skip
    for key in sorted(k for k in acc if k.endswith("_acceptance_length")):
        print(f"{key.split('_')[0]}: mean acceptance length {acc[key]:.2f} tokens/step")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
