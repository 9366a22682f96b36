"""`inferd bench spec`: speculative decoding against plain decoding, in one run, like the seeds' table.

Batch 1 (each prompt alone, greedy): tokens/s, acceptance rate, mean acceptance length and
speedup over speculation off, per proposer and depth k, on three tasks:
- input-grounded: "rewrite" (rewrite, proofread or repeat a given passage) and "code" (edit a
  given program: docstrings, a rename, a new method) — the output copies much of its input, where
  prompt lookup shines (as far as the target actually copies: a small model often rewrites code
  from scratch);
- "chat": open questions, where only a model (draft model, learned head) can guess ahead;
- "repeat": requests that recur, as agent traffic does (the same tool call, the same question):
  each run plays every prompt once untimed to configs that draft from other requests (suffix
  decoding), then times each again, its answer already written once.
Configs that draft from other requests forget them at the start of every run (and before every
batch run): on the other tasks a prompt's earlier run must not turn it into a repeat.
With --batch N, also N chat requests at once (the policy should keep throughput >= 0.95x of
speculation off). Every config's engine stays loaded and the configs take turns prompt by prompt;
a speedup is the median of per-run ratios (each run: every prompt once), so a change of the
machine's load hits both sides alike.
Greedy outputs must be identical to speculation off: the bench checks it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from inferd.bench.common import add_threads_arg, cpu_kernels_report, set_threads
from inferd.chat_prompts import CHAT_TASKS
from inferd.engine_args import parse_bytes

PASSAGES = (
    "The lighthouse stood at the end of the harbor wall for two hundred years. Every evening the "
    "keeper climbed the ninety steps, trimmed the wick and wound the clockwork that turned the "
    "lens. Ships from the north used its light to find the narrow channel between the rocks, and "
    "the town grew rich on the trade that came through it.",
    "Our team meeting is moved from Tuesday to Thursday at ten in the morning. Please bring the "
    "sales figures for the last quarter and your notes on the new product launch. If you cannot "
    "attend, send your update to Maria before Wednesday evening so that she can present it.",
    "Honeybees live in colonies of up to sixty thousand workers, one queen and a few hundred "
    "drones. The workers collect nectar and pollen, build the wax comb, care for the young and "
    "defend the hive. In winter the colony forms a tight cluster and shivers to keep warm.",
)
CODE = (
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef maximum(values):\n    best = values[0]\n"
    "    for v in values:\n        if v > best:\n            best = v\n    return best\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n\n    def reset(self):\n        self.count = 0\n",
)
REWRITE_TASKS = tuple(
    [f"Rewrite the following text, correcting any mistakes and keeping its meaning:\n\n{p}" for p in PASSAGES]
    + [f"Repeat this passage word for word, then give it a title:\n\n{PASSAGES[0]}"]
)  # fmt: skip
CODE_TASKS = tuple(
    [f"Add a docstring to every function in this Python code and return the whole code:\n\n{c}" for c in CODE]
    + ["Rename the variable `values` to `numbers` everywhere in this code and return the whole "
       f"code:\n\n{CODE[0]}",
       f"Add a method `decrement` to this class and return the whole class:\n\n{CODE[1]}"]
)  # fmt: skip
REPEAT_TASKS = (
    'Call the weather tool for Paris. Answer only with JSON of the form {"tool": "weather", '
    '"arguments": {"city": ..., "unit": ...}}.',
    "Write a Python function that reads a CSV file and returns its rows as a list of dictionaries.",
    "List the steps to reset a forgotten email password.",
    "What is the capital of Australia, and why was it chosen?",
)
TASKS = {"rewrite": REWRITE_TASKS, "code": CODE_TASKS, "chat": CHAT_TASKS, "repeat": REPEAT_TASKS}


def _chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def _run_batch1(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for the prompts one at a time, and the outputs."""
    from inferd import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs, start = [], time.perf_counter()
    for p in prompts:
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        outputs.append(out.outputs[0].token_ids)
    return time.perf_counter() - start, outputs


def _spec_counts(llm) -> tuple[int, int, int, int]:
    s = llm.engine.get_stats()
    return s.spec_num_drafts, s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_emitted_tokens


def _configs(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    configs: list[tuple[str, dict | None]] = [("off", None)]
    for k in args.k:
        if not args.no_ngram:
            configs.append((f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}))
        if args.draft_model:
            configs.append((f"draft k={k}", {"method": "draft_model", "model": args.draft_model,
                                             "num_speculative_tokens": k}))  # fmt: skip
        for topk in args.draft_topk if args.eagle else ():
            configs.append((f"eagle k={k}" + (f" topk={topk}" if topk > 1 else ""),
                            {"method": "eagle", "model": args.eagle, "num_speculative_tokens": k,
                             "draft_topk": topk}))  # fmt: skip
            if topk == 1 and getattr(args, "chain", False):  # the dynamic tree's own gain
                configs.append((f"eagle k={k} chain", {**configs[-1][1], "dynamic_tree": False}))
        for topk in args.draft_topk if getattr(args, "medusa", None) else ():
            configs.append((f"medusa k={k}" + (f" topk={topk}" if topk > 1 else ""),
                            {"method": "medusa", "model": args.medusa, "num_speculative_tokens": k,
                             "draft_topk": topk}))  # fmt: skip
    for k in args.suffix_k if args.suffix else ():
        configs.append((f"suffix k={k}", {"method": "suffix", "num_speculative_tokens": k}))
    for k in args.lookahead_k if args.lookahead else ():
        configs.append((f"lookahead k={k}", {"method": "lookahead", "num_speculative_tokens": k}))
    return configs


def _sharing(llm) -> bool:
    """Whether the config drafts from what other requests wrote."""
    proposer = llm.engine.proposer
    return proposer is not None and proposer.shares_across_requests


def _forget(llms: dict) -> None:
    for llm in llms.values():
        if _sharing(llm):
            llm.engine.proposer.forget()


def _speedup(times: list[float], base: list[float]) -> float:
    """Median over runs of the per-run ratio (each run of a config next to a run of speculation
    off): a change of the machine's load between configs hits both sides of a ratio alike."""
    return statistics.median(b / t for b, t in zip(base, times))


def run_spec(args: argparse.Namespace) -> dict:
    from inferd import LLM
    from inferd.loader import load_model

    set_threads(args.threads)
    loaded = load_model(args.model, verbose=False, quantization=args.quantization)
    tok = loaded.tokenizer
    tasks = {name: [_chat_ids(tok, t) for t in TASKS[name]] for name in args.tasks}
    # Every config's engine stays loaded and the configs take turns run by run (one warm-up first).
    # No prefix caching: every run computes its prompts whole, so each config's outputs can be
    # checked against speculation off bit for bit. (With int8 activations a cache hit computes the
    # prompt's tail on another attention path, which moves the first logits by up to ~0.15 nats.)
    llms = {label: LLM(loaded=loaded, verbose=False, quantization=args.quantization,
                       speculative_config=spec, kv_cache_memory=args.kv_cache_memory,
                       enable_prefix_caching=False)
            for label, spec in _configs(args)}  # fmt: skip
    for llm in llms.values():
        _run_batch1(llm, [tasks[args.tasks[0]][0]], 8)
    rows: list[dict] = []
    for task, prompts in tasks.items():
        before = {label: _spec_counts(llm) for label, llm in llms.items()}
        times: dict[str, list[float]] = {label: [] for label in llms}
        outputs: dict[str, list[list[int]]] = {label: [] for label in llms}
        labels = list(llms)
        for run in range(args.runs):
            for label in labels:
                times[label].append(0.0)
            _forget(llms)
            if task == "repeat":  # every answer written once, untimed (and left out of the counts)
                for label, llm in llms.items():
                    if _sharing(llm):
                        primed = _spec_counts(llm)
                        _run_batch1(llm, prompts, args.max_tokens)
                        before[label] = tuple(b + now - then for b, now, then
                                              in zip(before[label], _spec_counts(llm), primed))  # fmt: skip
            # The configs take turns prompt by prompt (who goes first rotating), so that the pair
            # behind a ratio runs seconds apart, not a whole run apart: a shared machine's speed
            # can move by ±15 % within minutes.
            for i, prompt in enumerate(prompts):
                turn = (run * len(prompts) + i) % len(labels)
                for label in labels[turn:] + labels[:turn]:
                    seconds, (out,) = _run_batch1(llms[label], [prompt], args.max_tokens)
                    times[label][-1] += seconds
                    outputs[label].append(out)
        reference = outputs["off"][: len(prompts)]  # every run of every config must give these
        for label, outs in outputs.items():
            if outs != reference * args.runs:
                raise SystemExit(f"{label} on {task}: greedy output differs from speculation off")
        tokens = sum(len(o) for o in reference)
        for label, llm in llms.items():
            drafts, proposed, accepted, emitted = (a - b for a, b in zip(_spec_counts(llm), before[label]))
            rows.append({"task": task, "config": label,
                         "tokens_per_s": round(tokens / statistics.median(times[label]), 1),
                         "speedup": round(_speedup(times[label], times["off"]), 2),
                         "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
                         "mean_acceptance_length": round(emitted / drafts, 2) if drafts else None})  # fmt: skip
    batch = _run_batch(llms, tasks, args) if args.batch else {}
    _print_table(rows, batch, args)
    kernels = cpu_kernels_report()
    if not kernels["cpu_kernels"]:
        print("note: inferd's CPU kernels are not loaded (see the line above on stderr): these "
              "figures are the PyTorch fallback's")  # fmt: skip
    report = {"bench": "spec", "max_tokens": args.max_tokens, "runs": args.runs, "rows": rows,
              "identical_greedy_outputs": True, **kernels,
              f"batch{args.batch}_tokens_per_s": {k: round(v[0], 1) for k, v in batch.items()},
              f"batch{args.batch}_ratio_vs_off": {k: round(v[1], 3) for k, v in batch.items()}}  # fmt: skip
    print(json.dumps(report))
    return report


def _run_batch(llms: dict, tasks: dict, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """`args.batch` chat requests at once, configs taking turns: {label: (tok/s, ratio vs off)}."""
    from inferd import SamplingParams

    chosen = {label: llm for label, llm in llms.items() if not label.startswith("draft") or args.batch_draft}
    pool = tasks.get("chat", next(iter(tasks.values())))
    prompts = [{"prompt_token_ids": pool[i % len(pool)]} for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    secs: dict[str, list[float]] = {label: [] for label in chosen}
    tokens = args.batch * args.max_tokens
    for run in range(args.runs):
        labels = list(chosen)
        _forget(chosen)
        for label in labels[run % len(labels):] + labels[: run % len(labels)]:
            start = time.perf_counter()
            chosen[label].generate(prompts, params, use_tqdm=False)
            secs[label].append(time.perf_counter() - start)
    return {label: (tokens / statistics.median(s), _speedup(s, secs["off"])) for label, s in secs.items()}


def _print_table(rows: list[dict], batch: dict[str, tuple[float, float]], args: argparse.Namespace) -> None:
    print(f"\nbatch 1, greedy, {args.max_tokens} tokens max, median of {args.runs} runs "
          "(outputs identical to speculation off)")  # fmt: skip
    print("| task | config | tokens/s | speedup | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rate = "—" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        mal = "—" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"| {r['task']} | {r['config']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {rate} | {mal} |")
    if batch:
        print(f"\nbatch {args.batch} (chat, {args.max_tokens} tokens each): "
              + ", ".join(f"{k}: {tps:.1f} tok/s ({ratio:.2f}×)" for k, (tps, ratio) in batch.items()))  # fmt: skip


def add_spec_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding vs plain decoding (batch 1 table, batch N check)")
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", "-q", default="auto")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--k", type=int, nargs="+", default=[3, 5], help="draft depths to compare")
    p.add_argument("--draft-model", default=None, help="a draft model (GGUF / HF dir) sharing the tokenizer")
    p.add_argument("--eagle", default=None, help="a trained draft head directory (inferd.train.train_eagle)")
    p.add_argument("--medusa", default=None, help="trained Medusa heads' directory (inferd.train.train_medusa)")
    p.add_argument("--draft-topk", type=int, nargs="+", default=[1],
                   help="eagle, medusa: draft trees to compare (1: k rows, the chain or, greedy, "
                        "its likeliest nodes with runner-ups; t: t - 1 more leaves per depth)")
    p.add_argument("--chain", action="store_true",
                   help="also run each eagle depth as plain chains (dynamic_tree off)")
    p.add_argument("--suffix", action="store_true",
                   help="add suffix decoding (drafts from this and earlier requests' text)")
    p.add_argument("--suffix-k", type=int, nargs="+", default=[16],
                   help="suffix decoding's depths (k) to compare")
    p.add_argument("--lookahead", action="store_true",
                   help="add lookahead decoding (drafts from the target's own Jacobi iterations)")
    p.add_argument("--lookahead-k", type=int, nargs="+", default=[5],
                   help="lookahead decoding's depths (k: a candidate n-gram and the window's guesses)")
    p.add_argument("--no-ngram", action="store_true",
                   help="leave prompt lookup out (e.g. a chat-only run of the models' proposers)")
    add_threads_arg(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=0, help="also compare throughput at this batch size")
    p.add_argument("--batch-draft", action="store_true", help="include draft-model configs in the batch run")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=512 << 20,
                   help="KV cache bytes of each config's engine (all stay loaded)")
    p.set_defaults(func=run_spec)
