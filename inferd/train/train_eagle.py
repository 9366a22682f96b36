"""Train the EAGLE-style draft head for a target model by self-distillation, then measure its
acceptance length on held-out chat prompts.

    python -m inferd.train.train_eagle [--model M] [--out DIR] [--num-prompts N] [--max-tokens M]
                                      [--epochs E] ...

1. the target (`inferd.LLM`, `--quantization auto` by default: the engine that will serve with the
   head) answers N chat instructions (temperature 0, a fraction at `--sample-temperature`) and the
   held-out eval instructions (temperature 0: the greedy continuation the acceptance is measured
   along), many at once;
2. the same model is run over every prompt + response: its hidden state at each position, the
   values the engine hands the head. Steps 1-2 are cached on disk (`$INFERD_CACHE_DIR/eagle-data`,
   keyed by everything that shapes them), so trying other training options skips them;
3. the head trains on those (eagle_train_core; the target's embedding and LM head dequantized to
   fp32), is saved to DIR (default $INFERD_CACHE_DIR/eagle/<model name>) with the draft vocabulary
   ranked from the responses (inferd.spec.draft_vocab), and its acceptance length at k = 3 and 5 is
   measured on the engine's own target, drafting as the engine does.
The last line printed is one JSON document.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from inferd.chat_prompts import CHAT_TASKS
from inferd.loader import load_model
from inferd.loader.default_model import cache_dir
from inferd.models import build_model
from inferd.spec import draft_vocab
from inferd.spec.eagle_head import EagleHead
from inferd.spec.eagle_io import CONFIG_FILE, WEIGHTS_FILE, check_feature_layers
from inferd.train.data_args import add_data_args, parse_with_threads
from inferd.train.draft_vocab import rank_tokens
from inferd.train.eagle_data import (
    EVAL_QUESTIONS,
    HiddenStates,
    generate_sequences,
    instructions,
    self_instruct,
    target_hidden_states,
)
from inferd.train.eagle_train_core import (
    PRECISIONS,
    TrainOptions,
    autocast_dtype,
    measure_acceptance,
    precision_name,
    prepare,
    train_head,
)

if TYPE_CHECKING:
    from inferd import LLM
    from inferd.loader.weights import LoadedModel


@dataclass(slots=True)
class EagleRecipe:
    model: str | None = None  # GGUF / HF dir; None: the default model
    out: str | None = None
    quantization: str = "auto"  # of the target generating the data (and serving later)
    num_prompts: int = 2048  # template instructions
    num_questions: int = 2048  # free-form questions the target writes itself (self-instruct)
    eval_prompts: int = 40
    max_tokens: int = 192
    sample_fraction: float = 0.25  # of training prompts answered at sample_temperature
    sample_temperature: float = 0.7
    intermediate_size: int | None = 1536
    kv_cache_memory: int = 2 << 30  # touched only as used
    draft_vocab_size: int = draft_vocab.DEFAULT_SIZE  # tokens greedy drafting scores; 0: all
    data_cache: bool = True  # keep the generated data (step 1-2) on disk for the next run
    init: str | None = None  # a saved head to continue training from (its sizes win)
    # Target layers whose outputs the head reads beside the final hidden state (EAGLE-3's
    # low/middle features); None: `default_feature_layers`, () for none.
    feature_layers: tuple[int, ...] | None = None
    data_only: bool = False  # generate and cache the data, then stop
    # The generated data's seed (which instructions, the sampled answers, the self-instruct
    # questions), apart from the training's (`train.seed`), so that retraining with another
    # seed reuses the cached data instead of generating it again (the recipe's slowest part).
    data_seed: int = 0
    progress: bool = False  # a progress bar while generating
    train: TrainOptions = field(default_factory=TrainOptions)


def default_out_dir(model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-") or "model"
    return cache_dir() / "eagle" / slug


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice beside the last layer: a low one (the third) and the middle one."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2}))


def _log(msg: str) -> None:
    print(f"train_eagle: {msg}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Distilled:
    """Step 1-2's output: token ids, prompt lengths and hidden states (fp16 on disk), per split."""

    train: HiddenStates
    train_prompt_lens: list[int]
    eval: HiddenStates
    eval_prompt_lens: list[int]
    num_questions: int = 0  # self-instruct sequences at the end of `train`


def _data_key(recipe: EagleRecipe, source: str, extra: list | None = None) -> str:
    """Everything that shapes the generated data (not the training options)."""
    fields = [
        source,
        recipe.quantization,
        recipe.num_prompts,
        recipe.eval_prompts,
        recipe.max_tokens,
        recipe.sample_fraction,
        recipe.sample_temperature,
        recipe.data_seed,
        "v2",
    ] + (extra or [])
    if recipe.feature_layers:  # (a key without them stays what it was)
        fields.append(["layers", *recipe.feature_layers])
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def distill(
    recipe: EagleRecipe, loaded: LoadedModel, times: dict[str, float]
) -> tuple[Distilled, torch.nn.Module]:
    """Generate the responses and the hidden states (or read them from the data cache); returns
    them and the engine's model (the target the head will serve with)."""
    from inferd import LLM

    llm = LLM(
        loaded=loaded,
        quantization=recipe.quantization,
        max_num_seqs=128,
        kv_cache_memory=recipe.kv_cache_memory,
        seed=recipe.data_seed,
        verbose=False,
    )
    model = llm.engine.runner.model
    data = _distill_instructions(recipe, llm, loaded.source, times)
    if recipe.num_questions:
        questions, lens = _distill_questions(recipe, llm, loaded.source, times)
        data.train = HiddenStates(
            data.train.tokens + questions.tokens, data.train.hidden + questions.hidden
        )
        data.train_prompt_lens = data.train_prompt_lens + lens
        data.num_questions = len(lens)
    return data, model


def _distill_instructions(
    recipe: EagleRecipe, llm: LLM, source: str, times: dict[str, float]
) -> Distilled:
    """The template instructions (train) and the held-out prompts (eval), cached."""
    model = llm.engine.runner.model
    path = cache_dir() / "eagle-data" / f"{_data_key(recipe, source)}.pt"
    if recipe.data_cache and path.is_file():
        saved = torch.load(path, weights_only=True)
        _log(f"data from {path}")
        return Distilled(
            HiddenStates(saved["train_tokens"], saved["train_hidden"]),
            saved["train_prompt_lens"],
            HiddenStates(saved["eval_tokens"], saved["eval_hidden"]),
            saved["eval_prompt_lens"],
        )
    t0 = time.perf_counter()
    train_prompts = instructions("train", recipe.num_prompts, recipe.data_seed)
    eval_prompts = instructions("eval", recipe.eval_prompts, recipe.data_seed)
    n_sampled = round(recipe.num_prompts * recipe.sample_fraction)
    temps = [recipe.sample_temperature] * n_sampled + [0.0] * (recipe.num_prompts - n_sampled)
    _log(
        f"generating {len(train_prompts)} + {len(eval_prompts)} responses "
        f"(<= {recipe.max_tokens} tokens)"
    )
    train_seqs, train_lens = generate_sequences(
        llm, train_prompts, recipe.max_tokens, temps, recipe.data_seed, progress=recipe.progress
    )
    eval_seqs, eval_lens = generate_sequences(
        llm, eval_prompts, recipe.max_tokens, [0.0] * len(eval_prompts)
    )
    times["generate_s"] = time.perf_counter() - t0
    n_response = sum(map(len, train_seqs)) - sum(train_lens)
    _log(f"generated {n_response} response tokens in {times['generate_s']:.0f} s")
    t0 = time.perf_counter()
    train_states = target_hidden_states(model, train_seqs, capture_layers=recipe.feature_layers)
    eval_states = target_hidden_states(model, eval_seqs, capture_layers=recipe.feature_layers)
    times["hidden_states_s"] = time.perf_counter() - t0
    n_positions = sum(map(len, train_seqs + eval_seqs))
    _log(f"hidden states of {n_positions} positions in {times['hidden_states_s']:.0f} s")
    # fp16 keeps the data cache small (the values are normed, |h| of order 1-10).
    data = Distilled(
        HiddenStates(train_states.tokens, [h.half() for h in train_states.hidden]),
        train_lens,
        HiddenStates(eval_states.tokens, [h.half() for h in eval_states.hidden]),
        eval_lens,
    )
    if recipe.data_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "train_tokens": data.train.tokens,
                "train_hidden": data.train.hidden,
                "train_prompt_lens": train_lens,
                "eval_tokens": data.eval.tokens,
                "eval_hidden": data.eval.hidden,
                "eval_prompt_lens": eval_lens,
            },
            path,
        )
    return data


def _distill_questions(
    recipe: EagleRecipe, llm: LLM, source: str, times: dict[str, float]
) -> tuple[HiddenStates, list[int]]:
    """Self-instruct: questions the target writes, its greedy answers and hidden states, cached."""
    model = llm.engine.runner.model
    key = _data_key(recipe, source, ["questions", recipe.num_questions])
    path = cache_dir() / "eagle-data" / f"{key}.pt"
    if recipe.data_cache and path.is_file():
        saved = torch.load(path, weights_only=True)
        _log(f"questions from {path}")
        return HiddenStates(saved["tokens"], saved["hidden"]), saved["prompt_lens"]
    t0 = time.perf_counter()
    held_out = list(CHAT_TASKS) + instructions("eval", recipe.eval_prompts, recipe.data_seed)
    questions = self_instruct(llm, recipe.num_questions, held_out, recipe.data_seed)
    _log(f"the target wrote {len(questions)} usable questions; answering them")
    if not questions:  # a model that writes no usable question (tiny random ones)
        return HiddenStates([], []), []
    seqs, lens = generate_sequences(
        llm,
        questions,
        recipe.max_tokens,
        [0.0] * len(questions),
        recipe.data_seed,
        progress=recipe.progress,
    )
    states = target_hidden_states(model, seqs, capture_layers=recipe.feature_layers)
    states = HiddenStates(states.tokens, [h.half() for h in states.hidden])
    times["questions_s"] = time.perf_counter() - t0
    if recipe.data_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "tokens": states.tokens,
                "hidden": states.hidden,
                "prompt_lens": lens,
                "questions": questions,
            },
            path,
        )
    return states, lens


def train_eagle(recipe: EagleRecipe) -> dict[str, Any]:
    """Run the whole recipe; returns the report (also written as DIR/train_report.json)."""
    from inferd.loader import DEFAULT_MODEL_NAME

    times: dict[str, float] = {}
    cpu0 = time.process_time()
    t_all = time.perf_counter()
    loaded = load_model(recipe.model, quantization=recipe.quantization, verbose=False)
    name = DEFAULT_MODEL_NAME if recipe.model is None else Path(loaded.source).stem
    out = Path(recipe.out) if recipe.out else default_out_dir(name)
    if recipe.feature_layers is None:
        recipe = replace(recipe, feature_layers=default_feature_layers(loaded.config.num_layers))
    # Before the long generation step, not after it.
    check_feature_layers(recipe.feature_layers, loaded.config.num_layers)
    data, served = distill(recipe, loaded, times)
    if recipe.data_only:
        return {"data_only": True, "seconds": {k: round(v, 1) for k, v in times.items()}}

    t0 = time.perf_counter()
    # fp32 (the file's blocks dequantized): the embedding and LM head the training reads.
    longest = max(map(len, data.train.tokens + data.eval.tokens))
    fp32 = build_model(
        loaded.config,
        loaded.weights,
        max_positions=longest + 1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    lm_weight = fp32.lm_head.weight.detach()  # fp32 [V, H]
    seqs = prepare(data.train, data.train_prompt_lens, lm_weight, recipe.train.precision)
    if recipe.init:
        # Continue from a saved head (another loss, more epochs): its sizes and weights, the
        # directory and the target checked as the engine checks them.
        # A head without feature layers may go on as one with them (theirs start at zero).
        saved = EagleHead.load(recipe.init, fp32)
        if saved.feature_layers and saved.feature_layers != recipe.feature_layers:
            raise ValueError(
                f"{recipe.init} reads target layers {list(saved.feature_layers)}, the "
                f"recipe's data {list(recipe.feature_layers)}: pass --feature-layers "
                f"{','.join(map(str, saved.feature_layers))}"
            )
        head = EagleHead.for_target(
            fp32, intermediate_size=saved.intermediate_size, feature_layers=recipe.feature_layers
        )
        state = load_file(str(Path(recipe.init).expanduser() / WEIGHTS_FILE))
        missing, unexpected = head.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"feature_fc.weight"}:
            raise ValueError(
                f"{recipe.init}: weights do not fit the head ({missing}, {unexpected})"
            )
        _log(f"continuing from {recipe.init}")
    else:
        head = EagleHead.for_target(
            fp32, intermediate_size=recipe.intermediate_size, feature_layers=recipe.feature_layers
        )
    _log(
        f"training a {head.num_parameters() / 1e6:.2f} M-parameter head on {len(seqs.tokens)} "
        f"sequences ({seqs.num_positions} positions)"
    )
    losses = train_head(head, seqs, fp32.embed_tokens, lm_weight, recipe.train, _log)
    times["train_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    head.requires_grad_(False)
    head.save(out)
    if 0 < recipe.draft_vocab_size < head.vocab_size:  # else: the whole vocabulary
        responses = [s[n:].tolist() for s, n in zip(data.train.tokens, data.train_prompt_lens)]
        draft_vocab.save(out, rank_tokens(responses, head.vocab_size, recipe.draft_vocab_size))
    # Measured as the engine drafts: the saved head on the served model, its draft vocabulary.
    engine_head = EagleHead.load(out, served, quantize=True)
    eval_starts = [
        n - 1 for n in data.eval_prompt_lens
    ]  # drafting starts at the last prompt position
    acceptance = measure_acceptance(engine_head, data.eval, eval_starts)
    n_free = min(recipe.eval_prompts, len(EVAL_QUESTIONS))  # the eval split starts with them
    if n_free:  # the free-form questions alone (unlike the training templates)
        free = HiddenStates(data.eval.tokens[:n_free], data.eval.hidden[:n_free])
        acceptance["free_form"] = measure_acceptance(engine_head, free, eval_starts[:n_free])
    times["eval_s"] = time.perf_counter() - t0
    size = sum((out / f).stat().st_size for f in (WEIGHTS_FILE, CONFIG_FILE))
    times["total_s"] = time.perf_counter() - t_all
    # CPU seconds of this process (all threads): on a shared machine, wall time mostly measures
    # the neighbours' load.
    times["cpu_s"] = time.process_time() - cpu0
    n_tokens = sum(map(len, data.train.tokens))
    report = {
        "model": loaded.source,
        "out": str(out),
        "head_parameters": head.num_parameters(),
        "size_bytes": size,
        "train_positions": n_tokens,  # prompt + response tokens
        "train_response_tokens": n_tokens - sum(data.train_prompt_lens),
        "train_sequences": len(seqs.tokens),
        "train_questions": data.num_questions,  # self-instruct ones among them
        "eval_prompts": len(data.eval.tokens),
        "data_seed": recipe.data_seed,
        "options": asdict(recipe.train),
        # what `precision` resolved to on this machine
        "training_matmuls": precision_name(
            autocast_dtype(recipe.train.precision, head.out_norm.weight.device)
        ),
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "acceptance": acceptance,
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _parse_layers(text: str) -> tuple[int, ...]:
    """`--feature-layers`: "2,15" (any order) or "none"."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated layer numbers: {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    r, t = EagleRecipe(), TrainOptions()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(p, r, "eagle")
    p.add_argument("--sample-fraction", type=float, default=r.sample_fraction)
    p.add_argument("--sample-temperature", type=float, default=r.sample_temperature)
    p.add_argument("--intermediate-size", type=int, default=r.intermediate_size)
    p.add_argument(
        "--init",
        default=None,
        help="a saved head directory to continue training from (e.g. with another "
        "--ce-weight or more epochs); --intermediate-size is then its own",
    )
    p.add_argument(
        "--feature-layers",
        default=None,
        type=_parse_layers,
        help="comma-separated target layers whose outputs the head reads beside the final "
        "hidden state (default: the third and the middle one); 'none' for none",
    )
    p.add_argument(
        "--data-only", action="store_true", help="generate and cache the data, then stop"
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=r.draft_vocab_size,
        help="frequent tokens greedy drafting scores (FR-Spec); 0: the whole vocabulary",
    )
    p.add_argument("--epochs", type=float, default=t.epochs)
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--unroll", type=int, default=t.unroll)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--ce-weight", type=float, default=t.ce_weight)
    p.add_argument(
        "--reg-weight",
        type=float,
        default=t.reg_weight,
        help="the feature regression's weight (0: cross-entropy alone)",
    )
    p.add_argument("--noise", type=float, default=t.noise)
    p.add_argument(
        "--ce-rows", type=float, default=t.ce_rows, help="share of rows the cross-entropy reads"
    )
    p.add_argument("--full-vocab-ce", action="store_true")
    p.add_argument(
        "--precision",
        default=t.precision,
        choices=PRECISIONS,
        help="the training matmuls' precision: auto = bf16 (autocast, fp32 weights) where "
        "the CPU or GPU computes bf16 natively, else fp32",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=t.seed,
        help="the training's seed (initial weights, batch order, noise); the data cache stays",
    )
    a = parse_with_threads(p, argv)
    opts = TrainOptions(
        epochs=a.epochs,
        batch_size=a.batch_size,
        unroll=a.unroll,
        lr=a.lr,
        ce_weight=a.ce_weight,
        reg_weight=a.reg_weight,
        noise=a.noise,
        full_vocab_ce=a.full_vocab_ce,
        ce_rows=a.ce_rows,
        precision=a.precision,
        seed=a.seed,
    )
    recipe = EagleRecipe(
        model=a.model,
        out=a.out,
        quantization=a.quantization,
        num_prompts=a.num_prompts,
        num_questions=a.num_questions,
        eval_prompts=a.eval_prompts,
        max_tokens=a.max_tokens,
        sample_fraction=a.sample_fraction,
        sample_temperature=a.sample_temperature,
        intermediate_size=a.intermediate_size,
        draft_vocab_size=a.draft_vocab_size,
        data_cache=not a.no_data_cache,
        init=a.init,
        feature_layers=a.feature_layers,
        data_only=a.data_only,
        data_seed=a.data_seed,
        progress=True,
        train=opts,
    )
    report = train_eagle(recipe)
    if recipe.data_only:
        print(json.dumps(report))
        return
    acc = report["acceptance"]
    secs = report["seconds"]
    print(
        f"saved {report['out']} ({report['size_bytes'] / 2**20:.1f} MiB, "
        f"{report['head_parameters'] / 1e6:.2f} M parameters) in {secs['total_s']:.0f} s "
        f"({secs['cpu_s']:.0f} CPU s)"
    )
    for k in (3, 5):
        free = acc.get("free_form", {}).get(f"k{k}_acceptance_length")
        print(
            f"k={k}: mean acceptance length {acc[f'k{k}_acceptance_length']:.2f} tokens/step "
            f"(per position {acc[f'k{k}_per_position']:.2f}"
            + (f"; free-form questions alone {free:.2f})" if free else ")")
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
