"""`inferd bench latency`: one batch, timed step by step, against the machine's own ceilings.

For inferd and each peer on the same prompts: prefill time (and FLOP/s achieved), decode step
latency (mean, p50, p90, p99), decode tokens/s, achieved GB/s of weights + KV read and FLOP/s, each
next to the ceilings `inferd bench roofline` measures in the same run. Batch 1 is the gpt-fast
question: how close to the memory-bandwidth limit does one stream decode?

Prefill is compute-bound: it is judged against the matmul peak, the fastest native path of this
CPU (fp32, bf16, int8, ...; the report names it), whatever precision the engine ran. Decode is
bandwidth-bound: each engine's bytes per step are what that engine reads (its own weight format
and KV dtype: `engine_costs`), against the matrix-vector bandwidth over as many bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from inferd.bench.common import add_model_args, cpu_kernels_report, set_threads, stats_ms
from inferd.bench.peers import LLAMA_CPP_MISSING, Timed, parse_peers
from inferd.bench.roofline import (
    Roofline,
    StepCost,
    best_of,
    engine_step_cost,
    matvec_n_for,
    measure_roofline,
    step_cost,
)
from inferd.config import DISTRIBUTED_EXECUTOR_BACKENDS, KV_CACHE_DTYPES
from inferd.engine_args import parse_bytes
from inferd.kv.kv_cache import kv_bytes_per_token


def summarize(
    runs: list[Timed], cost: StepCost, roof: Roofline, batch: int, input_len: int
) -> dict:
    """Medians over runs of one engine's prefill and decode figures, with achieved rates."""
    per_run = []
    for t in runs:
        steps = t.step_s
        # Decode step k (k = 1, 2, ...) attends over input_len + k cached tokens per sequence.
        bytes_total = flops_total = 0
        for k in range(1, len(steps) + 1):
            b, f = cost.decode_step([input_len + k] * batch)
            bytes_total, flops_total = bytes_total + b, flops_total + f
        decode_s = sum(steps)
        per_run.append({
            "prefill_s": t.ttft_s,
            "decode_step_ms": stats_ms(steps),
            "decode_tps": batch * len(steps) / decode_s if decode_s else 0.0,
            "decode_gbps": bytes_total / decode_s / 1e9 if decode_s else 0.0,
            "decode_gflops": flops_total / decode_s / 1e9 if decode_s else 0.0,
        })  # fmt: skip
    med = statistics.median
    prefill_s = med(r["prefill_s"] for r in per_run)
    prefill_gflops = cost.prefill_flops([input_len] * batch) / prefill_s / 1e9
    gbps = med(r["decode_gbps"] for r in per_run)
    gflops = med(r["decode_gflops"] for r in per_run)
    return {
        "prefill_s": round(prefill_s, 6),  # a tiny model on a fast CPU: well under 0.1 ms
        "prefill_tps": round(batch * input_len / prefill_s, 1),
        "prefill_gflops": round(prefill_gflops, 3),
        "prefill_pct_of_matmul_peak": round(100 * prefill_gflops / roof.matmul_gflops, 1),
        "decode_mb_per_step": round(cost.decode_step([input_len + 1] * batch)[0] / 1e6, 2),
        "decode_step_ms": {
            k: round(med(r["decode_step_ms"][k] for r in per_run), 2)
            for k in ("mean", "p50", "p90", "p99")
        },
        "decode_tps": round(med(r["decode_tps"] for r in per_run), 2),
        "decode_gbps": round(gbps, 3),
        "decode_pct_of_matvec_bw": round(100 * gbps / roof.matvec_gbps, 1),
        "decode_gflops": round(gflops, 3),
        "decode_pct_of_matmul_peak": round(100 * gflops / roof.matmul_gflops, 1),
    }


def ceiling_line(name: str, r: dict, roof: Roofline) -> str:
    """One engine's prefill and decode against the ceilings they are fractions of, named."""
    return (f"{name} prefill: {r['prefill_pct_of_matmul_peak']:.1f} % of {roof.describe_peak()}; "
            f"decode: {r['decode_pct_of_matvec_bw']:.1f} % of matrix-vector bandwidth "
            f"({roof.matvec_gbps:.1f} GB/s), {r['decode_mb_per_step']:.1f} MB read per "
            "step")  # fmt: skip


def engine_costs(engine, cost: StepCost, llama_gguf: Path | None,
                 openvino_gguf: Path | None = None) -> dict[str, StepCost]:  # fmt: skip
    """What each engine reads per step. inferd: `cost` (its weights as stored, its KV dtype). HF:
    the model dequantised to fp32, fp32 KV. llama.cpp: its GGUF copy's tensors, fp16 KV (its
    default). OpenVINO: an estimate, the GGUF's tensors and one byte per KV element (it converts
    the weights at load, and its CPU plugin keeps an int8 KV cache by default). The FLOPs are the
    model's, the same for all."""
    cfg = engine.model_config
    hf = step_cost(engine.runner.model, cfg.kv_bytes_per_token(torch.float32), bytes_per_weight=4)
    costs = {"inferd": cost, "hf": hf}
    if llama_gguf is not None:
        kv_f16 = cfg.kv_bytes_per_token(torch.float16)
        dense, experts = gguf_step_bytes(llama_gguf)
        costs["llama.cpp"] = replace(cost, weight_bytes=dense, expert_bytes=experts, kv_bytes_per_token=kv_f16)
    if openvino_gguf is not None:
        dense, experts = gguf_step_bytes(openvino_gguf)
        kv_i8 = cfg.kv_bytes_per_token(torch.int8)
        costs["openvino"] = replace(cost, weight_bytes=dense, expert_bytes=experts, kv_bytes_per_token=kv_i8)
    return costs


def gguf_step_bytes(path: Path) -> tuple[int, int]:
    """Bytes of a GGUF file's tensors one forward pass reads: all of them but an untied token
    embedding, of which a step only looks up rows; a mixture's stacked experts apart (dense,
    experts)."""
    from inferd.loader.gguf_file import read_gguf

    sizes = {t.name: t.n_bytes for t in read_gguf(Path(path)).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    return sum(sizes.values()) - experts, experts


def expert_load(model) -> dict | None:
    """Tokens routed to each expert of each mixture layer since the counters were last taken (the
    routing skew), with a one-line summary; None for a dense model."""
    from inferd.layers.moe import SparseMoE

    layers = {i: layer.mlp.take_expert_counts() for i, layer in enumerate(model.layers)
              if isinstance(layer.mlp, SparseMoE)}  # fmt: skip
    if not layers:
        return None
    counts = torch.stack(list(layers.values())).double()
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    uniform = 1 / counts.shape[1]
    return {
        "per_layer": {str(i): c.tolist() for i, c in layers.items()},
        "max_share": round(float(share.max()), 4),
        "min_share": round(float(share.min()), 4),
        "uniform_share": round(uniform, 4),
        "summary": (f"expert load over {len(layers)} MoE layers: busiest expert {100 * float(share.max()):.1f} % "
                    f"of a layer's routed tokens, idlest {100 * float(share.min()):.1f} % "
                    f"(uniform {100 * uniform:.1f} %)"),
    }  # fmt: skip


def _print_table(report: dict) -> None:
    print(f"\n{'engine':<10} {'prefill s':>9} {'GFLOP/s':>8} {'step p50':>9} {'p90':>7} "
          f"{'p99':>7} {'tok/s':>7} {'GB/s':>6} {'% bw':>5} {'GFLOP/s':>8}")  # fmt: skip
    for name, r in report["engines"].items():
        s = r["decode_step_ms"]
        print(f"{name:<10} {r['prefill_s']:>9.3f} {r['prefill_gflops']:>8.1f} {s['p50']:>7.1f}ms "
              f"{s['p90']:>5.1f}ms {s['p99']:>5.1f}ms {r['decode_tps']:>7.1f} "
              f"{r['decode_gbps']:>6.1f} {r['decode_pct_of_matvec_bw']:>5.1f} "
              f"{r['decode_gflops']:>8.1f}")  # fmt: skip


def run_latency(args: argparse.Namespace) -> dict:
    from inferd import LLM
    from inferd.bench import peers
    from inferd.bench.prompts import synthetic_prompt
    from inferd.loader import load_model, resolve_model_path

    b, n_in, n_out = args.batch_size, args.input_len, args.output_len
    if b < 1 or n_in < 1 or n_out < 2 or args.runs < 1:
        raise ValueError("--batch-size, --input-len and --runs must be ≥ 1 and --output-len "
                         "≥ 2 (a decode step needs a token after the first)")  # fmt: skip
    wanted = parse_peers(args.peers)
    sampled = args.temperature > 0
    if sampled and wanted:  # the peers' runs are greedy: a sampled inferd would not be comparable
        raise ValueError("--temperature > 0 measures inferd's sampling alone: pass --peers none")
    set_threads(args.threads)
    path = resolve_model_path(args.model)
    loaded = load_model(path, verbose=False, quantization=args.quantization)
    prompts = [synthetic_prompt(loaded.tokenizer, n_in, seed=i) for i in range(b)]
    # One prefill step for the whole batch (so the first stamp is the prefill's end), no prefix
    # cache (every run computes its prompts), a pool that holds the batch.
    kv_memory = args.kv_cache_memory
    if kv_memory is None:  # the whole batch at its full length, with a block of slack per sequence
        per_token = kv_bytes_per_token(loaded.config, torch.float32, args.kv_cache_dtype)
        kv_memory = max(256 << 20, b * (n_in + n_out + 64) * per_token)
    llm = LLM(loaded=loaded, verbose=False, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=b, max_num_batched_tokens=max(2048, b * n_in),
              enable_prefix_caching=False, kv_cache_memory=kv_memory,
              kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=args.distributed_executor_backend)  # fmt: skip
    engine = llm.engine
    engine.runner.wait_kv_prefault()
    cost = engine_step_cost(engine)
    # The matrix-vector ceiling over as many bytes as a step's weights: where they live (a cache
    # or DRAM) sets how fast they can stream.
    matvec_n = matvec_n_for(cost.weight_bytes_read(b), engine.dtype)
    roof = measure_roofline(engine.dtype, matvec_n=matvec_n, budget_s=1.5)
    print(f"torch threads {torch.get_num_threads()}; batch {b}, {n_in} prompt tokens, {n_out} "
          f"new tokens, median of {args.runs} runs; ceilings: matrix-vector "
          f"{roof.matvec_gbps:.1f} GB/s, {roof.describe_peak()}; "
          f"{cost.weight_bytes_read(b) / 1e6:.1f} MB of weights per step", file=sys.stderr)  # fmt: skip
    runs: dict[str, list[Timed]] = {"inferd": []}
    peers.inferd_generate_timed(engine, prompts[:1], 4)  # warm-up (kernels built, pages touched)
    notes: list[str] = []
    hf_model = llama = None
    if "hf" in wanted:
        hf_model = peers.load_hf(path)
        pad = loaded.tokenizer.eos_token_id or 0
        peers.hf_generate_timed(hf_model, prompts[:1], 4, pad)
        runs["hf"] = []
    if "llama.cpp" in wanted:
        if not peers.llama_cpp_available():
            notes.append(LLAMA_CPP_MISSING)
        elif b > 1:
            notes.append("llama.cpp peer skipped: its Llama API runs one sequence (batch 1 only)")
        elif path.suffix != ".gguf":
            notes.append("llama.cpp peer skipped: the model is not a GGUF file")
        else:
            ftype = peers.peer_gguf_type(args.quantization)
            llama = peers.LlamaCppPeer(peers.gguf_copy(path, ftype), n_ctx=n_in + n_out + 16)
            llama.generate_timed(prompts[0], 4)
            runs["llama.cpp"] = []
            notes.append(
                f"llama.cpp runs {llama.path.name} ({ftype if ftype != 'same' else 'as shipped'})"
            )
    ov = None
    if "openvino" in wanted:
        from inferd.bench.openvino_peer import OPENVINO_MISSING, OpenVinoPeer, openvino_available

        if not openvino_available():
            notes.append(OPENVINO_MISSING)
        elif path.suffix != ".gguf":
            notes.append("openvino peer skipped: the model is not a GGUF file")
        else:
            ov = OpenVinoPeer(path, max_num_seqs=b, max_num_batched_tokens=max(2048, b * n_in))
            ov.generate_timed(prompts[:1], 4)  # warm-up (its first step compiles)
            runs["openvino"] = []
            notes.append(f"openvino runs {path.name} (converted at load; its CPU plugin's own "
                         "precisions), prefix caching off")  # fmt: skip
    for note in notes:
        print(note, file=sys.stderr)
    expert_load(engine.runner.model)  # (counted from here: the timed runs only)
    # Engines interleave run by run: load from other jobs on the machine hits all of them alike.
    for i in range(args.runs):
        runs["inferd"].append(
            peers.inferd_generate_timed(engine, prompts, n_out, args.temperature, args.top_p)
        )
        if hf_model is not None:
            runs["hf"].append(peers.hf_generate_timed(hf_model, prompts, n_out, pad))
        if llama is not None:
            runs["llama.cpp"].append(llama.generate_timed(prompts[0], n_out))
        if ov is not None:
            runs["openvino"].append(ov.generate_timed(prompts, n_out))
        rates = ", ".join(f"{k} {v[-1].decode_tps * b:.1f} tok/s" for k, v in runs.items())
        print(f"run {i + 1}: {rates}", file=sys.stderr)
    if llama is not None:
        llama.close()
    if ov is not None:
        ov.close()
    # Ceilings measured again after the runs; each is the better of the two: a ceiling caught at a
    # moment when other jobs held the cores would flatter every engine's share of it.
    roof = best_of(roof, measure_roofline(engine.dtype, matvec_n=matvec_n, budget_s=1.5))
    limits = {
        "bandwidth_limit_tps": round(
            b * roof.matvec_gbps * 1e9 / cost.decode_step([n_in] * b)[0], 1
        ),
        "compute_limit_tps": round(roof.matmul_gflops * 1e9 / cost.linear_flops_per_token, 1),
        "compute_limit_path": roof.peak.name,
    }
    costs = engine_costs(engine, cost, llama.path if llama is not None else None,
                         path if ov is not None else None)  # fmt: skip
    report: dict = {
        "bench": "latency", "model": str(path), "quantization": args.quantization,
        "dtype": str(engine.dtype).removeprefix("torch."), "kv_cache_dtype": args.kv_cache_dtype,
        "batch_size": b, "input_len": n_in, "temperature": args.temperature, "top_p": args.top_p,
        "output_len": n_out, "runs": args.runs, "threads": torch.get_num_threads(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
        **cpu_kernels_report(), "roofline": roof.as_dict(),
        "weight_mb_per_step": round(cost.weight_bytes_read(b) / 1e6, 1),
        "mflop_per_token": round(cost.linear_flops_per_token / 1e6, 1), "limits": limits,
        "notes": notes,
        "engines": {k: summarize(v, costs[k], roof, b, n_in) for k, v in runs.items()},
    }  # fmt: skip
    base = report["engines"]["inferd"]["decode_tps"]
    report["inferd_pct_of_bandwidth_limit"] = round(100 * base / limits["bandwidth_limit_tps"], 1)
    load = expert_load(engine.runner.model)
    if load is not None:
        report["expert_load"] = load
    report["ratio_inferd_vs"] = {
        k: round(base / r["decode_tps"], 2) for k, r in report["engines"].items() if k != "inferd"
    }
    _print_table(report)
    for name, r in report["engines"].items():
        print(ceiling_line(name, r, roof))
    ratios = ", ".join(f"{k} {v}×" for k, v in report["ratio_inferd_vs"].items()) or "no peer"
    print(f"bandwidth limit at batch {b}: {limits['bandwidth_limit_tps']} tok/s (inferd at "
          f"{report['inferd_pct_of_bandwidth_limit']}%); inferd decode vs {ratios}")  # fmt: skip
    if load is not None:
        print(load["summary"])
    llm.close()
    print(json.dumps(report))
    return report


def add_latency_parser(sub) -> None:
    p = sub.add_parser(
        "latency",
        help="one batch step by step: prefill, decode latency, GB/s and FLOP/s vs ceilings",
    )
    add_model_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians (noisy machines)")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV pool size (e.g. 1GiB; default: what the batch needs, 256 MiB at least)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="inferd's KV storage (auto: the model dtype; llama.cpp keeps "
                        "fp16)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature instead of greedy (inferd only: "
                        "--peers none)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="inferd's ranks (docs/scale-out.md): each takes cores / N threads, "
                        "overriding --threads")  # fmt: skip
    p.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                   default="mp", help="how the ranks start: mp processes, or ray actors")  # fmt: skip
    p.set_defaults(func=run_latency)
