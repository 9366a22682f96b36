"""The seeds' benchmark scenarios, runnable by name, inferd and its peers in one run.

| name          | the seed's table                                   | here                                       |
|---------------|----------------------------------------------------|--------------------------------------------|
| throughput    | 32 concurrent, 128-token prompts: tok/s            | N requests × (in, out): aggregate tok/s,   |
|               |                                                    | and one stream's decode tok/s and TTFT     |
| multi-turn    | 5-turn chat with shared history: TTFT, end-to-end  | TTFT per turn, conversation end-to-end     |
| shared-prefix | many requests sharing a long system prompt         | mean TTFT, total time, prefill computed    |
| long-context  | memory growth and speed decay up to long contexts  | prefill, decode tok/s and KV bytes per     |
|               |                                                    | context length up to the model's maximum   |

Every engine sees the same token ids. inferd runs with its prefix cache on (flushed before each
run: nothing is served from an earlier run) and, where the cache is the point, off as well. HF
transformers runs static batches and recomputes every prompt; llama.cpp (`Llama`) runs one
sequence at a time and reuses the KV of the prompt it evaluated last (as its server slot does);
OpenVINO GenAI (throughput only) batches continuously with its prefix cache off.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.bench.peers import PeerSet, Timed, hf_generate_timed, hf_kv_bytes, inferd_generate_timed
from inferd.bench.prompts import synthetic_prompt

med = statistics.median


@dataclass(slots=True)
class BenchContext:
    """What every scenario needs: the loaded model, the peers, and how to build inferd."""

    path: Path
    loaded: Any  # inferd.loader.LoadedModel
    peers: PeerSet
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def engine(self, **overrides):
        from inferd import LLM

        kwargs = {**self.llm_kwargs, **overrides}
        engine = LLM(loaded=self.loaded, verbose=False, **kwargs).engine
        engine.runner.wait_kv_prefault()
        return engine


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    defaults: dict[str, Any]  # values of the CLI flags left unset
    run: Callable[[BenchContext, argparse.Namespace], dict]


def _rounded(field: str, value: float) -> float:
    """A reported figure: seconds to the microsecond (a tiny model's TTFT is under a millisecond
    on a fast CPU: 3 decimals would print it as 0), the rest to 3 decimals."""
    return round(value, 6 if field.endswith("_s") else 3)


def _ratios(engines: dict[str, dict], key: str, higher_is_better: bool = True) -> dict[str, float]:
    """inferd's figure over each other engine's (or theirs over inferd's for times)."""
    base = engines["inferd"][key]
    out = {}
    for name, r in engines.items():
        if name != "inferd" and r.get(key):
            out[name] = round(base / r[key] if higher_is_better else r[key] / base, 2)
    return out


# ---- throughput -------------------------------------------------------------------------------


def throughput(ctx: BenchContext, a: argparse.Namespace) -> dict:
    n, n_in, n_out = a.num_prompts, a.input_len, a.output_len
    prompts = [synthetic_prompt(ctx.tokenizer, n_in, seed=i) for i in range(n)]
    engine = ctx.engine(max_num_seqs=max(n, 1), max_num_batched_tokens=a.max_num_batched_tokens)
    inferd_generate_timed(engine, prompts[:2], 4)  # warm-up
    hf = ctx.peers.hf()
    llama = ctx.peers.llama_cpp(n_ctx=n_in + n_out + 16)
    if llama is not None:
        ctx.peers.notes.append("llama.cpp's Llama API serves one sequence at a time: its "
                               f"{n}-request figure is sequential (one request's rate)")  # fmt: skip
    ov = ctx.peers.openvino(max(n, 1), a.max_num_batched_tokens)
    runs: dict[str, list[dict]] = (
        {"inferd": []} | ({"hf": []} if hf else {}) | ({"llama.cpp": []} if llama else {})
        | ({"openvino": []} if ov else {})
    )  # fmt: skip

    def record(name: str, single: Timed, batch_tps: float) -> None:
        runs[name].append({"single_decode_tps": single.decode_tps, "single_ttft_s": single.ttft_s,
                           "batch_tps": batch_tps})  # fmt: skip

    for i in range(a.runs):  # engines interleaved: load from other jobs hits all alike
        engine.reset_prefix_cache()
        single = inferd_generate_timed(engine, prompts[:1], n_out)
        engine.reset_prefix_cache()
        batch = inferd_generate_timed(engine, prompts, n_out)
        record("inferd", single, n * n_out / batch.total_s)
        if hf is not None:
            single = hf_generate_timed(hf, prompts[:1], n_out, ctx.peers.pad_id)
            batch = hf_generate_timed(hf, prompts, n_out, ctx.peers.pad_id)
            record("hf", single, n * n_out / batch.total_s)
        if llama is not None:
            single = llama.generate_timed(prompts[0], n_out)
            record("llama.cpp", single, n_out / single.total_s)
        if ov is not None:
            single = ov.generate_timed(prompts[:1], n_out)
            batch = ov.generate_timed(prompts, n_out)
            record("openvino", single, n * n_out / batch.total_s)
        print(
            f"run {i + 1}: "
            + ", ".join(f"{k} {v[-1]['batch_tps']:.1f} tok/s" for k, v in runs.items())
        )
    engines = {k: {f: _rounded(f, med(r[f] for r in v)) for f in v[0]} for k, v in runs.items()}
    report = {"engines": engines,
              "ratio_single_decode": _ratios(engines, "single_decode_tps"),
              "ratio_batch": _ratios(engines, "batch_tps")}  # fmt: skip
    print(
        f"\n{'engine':<10} {'1-stream decode tok/s':>22} {'TTFT s':>8} {f'{n}-request tok/s':>18}"
    )
    for name, r in engines.items():
        print(
            f"{name:<10} {r['single_decode_tps']:>22.1f} {r['single_ttft_s']:>8.3f} {r['batch_tps']:>18.1f}"
        )
    for peer in report["ratio_batch"]:
        print(f"inferd / {peer}: single-stream {report['ratio_single_decode'][peer]}×, "
              f"{n}-request {report['ratio_batch'][peer]}×")  # fmt: skip
    return report


# ---- multi-turn -------------------------------------------------------------------------------


def multi_turn(ctx: BenchContext, a: argparse.Namespace) -> dict:
    """A system prompt and `turns` user turns; each turn's prompt is the whole history. inferd
    (cache on) writes the answers in the first run; every engine then replays the same prompts."""
    tok = ctx.tokenizer
    system = synthetic_prompt(tok, a.prefix_len, seed=7)
    users = [synthetic_prompt(tok, a.input_len, seed=1000 + t) for t in range(a.turns)]
    on = ctx.engine(enable_prefix_caching=True)
    off = ctx.engine(enable_prefix_caching=False)
    inferd_generate_timed(on, [system[:8]], 2)  # warm-up
    inferd_generate_timed(off, [system[:8]], 2)
    prompts: list[list[int]] = []
    history = list(system)
    for t in range(a.turns):  # build the conversation (not timed)
        prompts.append(history + users[t])
        answer = inferd_generate_timed(on, [prompts[-1]], a.output_len).token_ids[0]
        history = prompts[-1] + answer
    max_ctx = len(prompts[-1]) + a.output_len + 16
    hf = ctx.peers.hf()
    llama = ctx.peers.llama_cpp(n_ctx=max_ctx)

    def conversation(name: str) -> list[Timed]:
        out = []
        for p in prompts:
            if name == "inferd":
                out.append(inferd_generate_timed(on, [p], a.output_len))
            elif name == "inferd-no-cache":
                out.append(inferd_generate_timed(off, [p], a.output_len))
            elif name == "hf":
                out.append(hf_generate_timed(hf, [p], a.output_len, ctx.peers.pad_id))
            else:  # llama.cpp keeps its context across turns, like a server slot would
                out.append(llama.generate_timed(p, a.output_len, keep_cache=bool(out)))
        return out

    names = (
        ["inferd", "inferd-no-cache"] + (["hf"] if hf else []) + (["llama.cpp"] if llama else [])
    )
    runs: dict[str, list[list[Timed]]] = {k: [] for k in names}
    for i in range(a.runs):
        on.reset_prefix_cache()
        for name in names:
            runs[name].append(conversation(name))
        print(f"run {i + 1}: " + ", ".join(
            f"{k} e2e {sum(t.total_s for t in v[-1]):.2f} s" for k, v in runs.items()))  # fmt: skip
    engines = {}
    for name, convs in runs.items():
        per_turn = [med(c[t].ttft_s for c in convs) for t in range(a.turns)]
        engines[name] = {"ttft_per_turn_s": [round(x, 4) for x in per_turn],
                         "mean_ttft_s": round(statistics.mean(per_turn), 4),
                         "e2e_s": round(med(sum(t.total_s for t in c) for c in convs), 3)}  # fmt: skip
    report = {"prompt_tokens_per_turn": [len(p) for p in prompts], "engines": engines,
              "ratio_mean_ttft": _ratios(engines, "mean_ttft_s", higher_is_better=False),
              "ratio_e2e": _ratios(engines, "e2e_s", higher_is_better=False)}  # fmt: skip
    print(
        f"\n{a.turns}-turn chat, prompts {report['prompt_tokens_per_turn']} tokens, {a.output_len}-token answers"
    )
    print(f"{'engine':<16} {'mean TTFT s':>11} {'e2e s':>7}  TTFT per turn (s)")
    for name, r in engines.items():
        print(f"{name:<16} {r['mean_ttft_s']:>11.3f} {r['e2e_s']:>7.2f}  {r['ttft_per_turn_s']}")
    print(
        "time of each peer / inferd's: TTFT "
        + str(report["ratio_mean_ttft"])
        + ", e2e "
        + str(report["ratio_e2e"])
    )
    return report


# ---- shared-prefix ----------------------------------------------------------------------------


def shared_prefix(ctx: BenchContext, a: argparse.Namespace) -> dict:
    """`num_prompts` requests = one `prefix_len` system prompt + distinct `input_len` suffixes,
    all arriving at once, cache flushed first: inferd computes the prefix once for all of them."""
    tok = ctx.tokenizer
    prefix = synthetic_prompt(tok, a.prefix_len, seed=7)
    prompts = [
        prefix + synthetic_prompt(tok, a.input_len, seed=100 + i) for i in range(a.num_prompts)
    ]
    n, n_out = len(prompts), a.output_len
    kw = {"max_num_seqs": n, "max_num_batched_tokens": a.max_num_batched_tokens}
    on, off = (
        ctx.engine(enable_prefix_caching=True, **kw),
        ctx.engine(enable_prefix_caching=False, **kw),
    )
    for e in (on, off):
        inferd_generate_timed(e, [prefix[:8]], 2)  # warm-up
    hf = ctx.peers.hf()
    llama = ctx.peers.llama_cpp(n_ctx=len(prompts[0]) + n_out + 16)
    runs: dict[str, list[dict]] = {"inferd": [], "inferd-no-cache": []}
    runs |= ({"hf": []} if hf else {}) | ({"llama.cpp": []} if llama else {})

    def record(name: str, ttfts: list[float], total_s: float, computed: int | None = None) -> None:
        runs[name].append({"mean_ttft_s": statistics.mean(ttfts), "total_s": total_s,
                           "output_tps": n * n_out / total_s, "prefill_tokens_computed": computed})  # fmt: skip

    for i in range(a.runs):
        for name, e in (("inferd", on), ("inferd-no-cache", off)):
            e.reset_prefix_cache()
            before = e.get_stats().prompt_tokens_total
            t = inferd_generate_timed(e, prompts, n_out)
            record(name, t.request_ttft_s, t.total_s, e.get_stats().prompt_tokens_total - before)
        if hf is not None:
            t = hf_generate_timed(hf, prompts, n_out, ctx.peers.pad_id)
            record("hf", t.request_ttft_s, t.total_s, n * len(prompts[0]))
        if llama is not None:  # one after another: request j's TTFT includes the ones before it
            start, ttfts = None, []
            llama.llm.reset()
            for p in prompts:
                t = llama.generate_timed(p, n_out, keep_cache=True)
                start = start if start is not None else t.start
                ttfts.append(t.first[0] - start)
            record("llama.cpp", ttfts, t.end - start)
        print(
            f"run {i + 1}: "
            + ", ".join(f"{k} mean TTFT {v[-1]['mean_ttft_s']:.2f} s" for k, v in runs.items())
        )
    engines = {k: {f: (_rounded(f, med(r[f] for r in v)) if v[0][f] is not None else None) for f in v[0]}
               for k, v in runs.items()}  # fmt: skip
    report = {"num_requests": n, "prefix_len": a.prefix_len, "suffix_len": a.input_len, "engines": engines,
              "ratio_mean_ttft": _ratios(engines, "mean_ttft_s", higher_is_better=False),
              "ratio_output_tps": _ratios(engines, "output_tps")}  # fmt: skip
    print(
        f"\n{n} requests sharing a {a.prefix_len}-token prefix (+{a.input_len} each), {n_out} tokens out"
    )
    print(
        f"{'engine':<16} {'mean TTFT s':>11} {'total s':>8} {'out tok/s':>9} {'prefill computed':>17}"
    )
    for name, r in engines.items():
        print(f"{name:<16} {r['mean_ttft_s']:>11.3f} {r['total_s']:>8.2f} {r['output_tps']:>9.1f} "
              f"{r['prefill_tokens_computed'] if r['prefill_tokens_computed'] is not None else '-':>17}")  # fmt: skip
    return report


# ---- long-context -----------------------------------------------------------------------------


def _context_lens(spec: str, max_len: int) -> list[int]:
    lens = sorted({max_len if x.strip() == "max" else int(x) for x in spec.split(",") if x.strip()})
    if not lens or lens[0] < 1 or lens[-1] > max_len:
        raise ValueError(f"--context-lens must be in [1, {max_len}] (or 'max'), got {spec!r}")
    return lens


def long_context(ctx: BenchContext, a: argparse.Namespace) -> dict:
    """One request per context length up to the model's maximum: prefill time, decode tokens/s
    and KV bytes held; growth and decay from the shortest to the longest."""
    cfg = ctx.loaded.config
    max_len = cfg.max_position_embeddings - a.output_len
    lens = _context_lens(a.context_lens, max_len)
    engine = ctx.engine(max_num_seqs=1, max_num_batched_tokens=a.max_num_batched_tokens)
    bs, kv_tok = engine.kv.block_size, cfg.kv_bytes_per_token(engine.dtype)
    if lens[-1] + a.output_len > engine.max_model_len:
        raise ValueError(f"context {lens[-1]} + {a.output_len} exceeds the KV pool's {engine.max_model_len} "
                         "tokens; raise --kv-cache-memory")  # fmt: skip
    inferd_generate_timed(engine, [[1] * 8], 2)  # warm-up
    hf = ctx.peers.hf()
    n_ctx = min(lens[-1] + a.output_len + 16, cfg.max_position_embeddings)  # not past training
    llama = ctx.peers.llama_cpp(n_ctx=n_ctx)
    if llama is not None:
        ctx.peers.notes.append(f"llama.cpp allocates its KV for n_ctx={n_ctx} up front")
    points = []
    for n in lens:
        prompt = synthetic_prompt(ctx.tokenizer, n, seed=n)
        runs: dict[str, list[Timed]] = (
            {"inferd": []} | ({"hf": []} if hf else {}) | ({"llama.cpp": []} if llama else {})
        )
        for _ in range(a.runs):
            engine.reset_prefix_cache()
            runs["inferd"].append(inferd_generate_timed(engine, [prompt], a.output_len))
            if hf is not None:
                runs["hf"].append(hf_generate_timed(hf, [prompt], a.output_len, ctx.peers.pad_id))
            if llama is not None:
                runs["llama.cpp"].append(llama.generate_timed(prompt, a.output_len))
        # Whole blocks of the paged pool; with KV cache groups a block holds one group's layers,
        # and windowed groups hold about a window (inferd/kv/kv_groups.py).
        layout = engine.kv.layout
        block_bytes = bs * kv_tok * layout.group_size // cfg.num_layers
        kv = {"inferd": layout.blocks_for(n + a.output_len, bs, a.max_num_batched_tokens) * block_bytes}
        if hf is not None:
            kv["hf"] = hf_kv_bytes(hf, n + a.output_len)
        point = {"context": n, "engines": {}}
        for name, ts in runs.items():
            prefill = med(t.ttft_s for t in ts)
            point["engines"][name] = {"prefill_s": round(prefill, 3), "prefill_tps": round(n / prefill, 1),
                                      "decode_tps": round(med(t.decode_tps for t in ts), 2),
                                      "kv_mib": round(kv[name] / 2**20, 1) if name in kv else None}  # fmt: skip
        points.append(point)
        print(f"context {n}: " + ", ".join(
            f"{k} prefill {r['prefill_s']:.2f} s decode {r['decode_tps']:.1f} tok/s"
            for k, r in point["engines"].items()))  # fmt: skip
    first, last = points[0]["engines"], points[-1]["engines"]
    summary = {}
    for name in last:
        s = {
            "decode_decay_pct": round(
                100 * (1 - last[name]["decode_tps"] / first[name]["decode_tps"]), 1
            )
        }
        if last[name]["kv_mib"] is not None:
            s["kv_mib_at_max"] = last[name]["kv_mib"]
        summary[name] = s
    report = {
        "context_lens": lens,
        "output_len": a.output_len,
        "points": points,
        "from_shortest_to_longest": summary,
    }
    print(f"\ndecode speed from {lens[0]} to {lens[-1]} tokens of context: " + ", ".join(
        f"{k} −{s['decode_decay_pct']}%" for k, s in summary.items()))  # fmt: skip
    return report


def _lora_scenario(ctx: BenchContext, a: argparse.Namespace) -> dict:
    from inferd.bench.lora import lora

    return lora(ctx, a)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "throughput",
            "N concurrent requests × (in, out): aggregate and single-stream tok/s",
            {"num_prompts": 32, "input_len": 128, "output_len": 128, "runs": 3},
            throughput,
        ),
        Scenario(
            "multi-turn",
            "5-turn chat over a shared system prompt: TTFT per turn, end-to-end",
            {"turns": 5, "prefix_len": 256, "input_len": 64, "output_len": 64, "runs": 2},
            multi_turn,
        ),
        Scenario(
            "shared-prefix",
            "requests sharing a long system prompt, arriving together: TTFT",
            {"num_prompts": 16, "prefix_len": 512, "input_len": 32, "output_len": 32, "runs": 2},
            shared_prefix,
        ),
        Scenario(
            "lora",
            "N concurrent requests over K LoRA adapters vs the same without LoRA: tok/s ratio",
            {"num_prompts": 32, "input_len": 128, "output_len": 128, "runs": 3, "lora_adapters": 4,
             "lora_rank": 8},
            lambda ctx, a: _lora_scenario(ctx, a),
        ),
        Scenario(
            "long-context",
            "prefill, decode speed and KV memory as context grows to the maximum",
            {"context_lens": "512,2048,max", "output_len": 32, "runs": 1},
            long_context,
        ),
    )
}
