"""`inferd bench offline`: single-stream decode and N-request aggregate throughput of the offline
API, with HF transformers' `generate` (static batching) on the same prompts in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RunResult:
    single_decode_tps: float  # decode tokens/s of one stream, first token excluded
    single_ttft_s: float
    batch_tps: float  # generated tokens / wall seconds for the whole batch
    batch_seconds: float


def _inferd_run(llm, prompts: list[list[int]], output_len: int) -> RunResult:
    from inferd import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    (single,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    m = single.metrics
    n = len(single.outputs[0].token_ids)
    decode_tps = (n - 1) / (m.finished_time - m.first_token_time)
    ttft = m.first_token_time - m.arrival_time
    del start
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    return RunResult(decode_tps, ttft, total / secs, secs)


def _hf_run(model, prompts: list[list[int]], output_len: int, pad_id: int) -> RunResult:
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=pad_id)  # fmt: skip
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                       do_sample=False, pad_token_id=pad_id)  # fmt: skip
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        single = time.perf_counter() - t0
        decode_tps = (output_len - 1) / max(single - ttft, 1e-9)
        # Static batch, left padded: "the traditional way".
        width = max(len(p) for p in prompts)
        batch = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=mask, **kwargs)
        secs = time.perf_counter() - t0
    total = (out.shape[1] - width) * len(prompts)
    return RunResult(decode_tps, ttft, total / secs, secs)


def _median(runs: list[RunResult], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def run_offline(args: argparse.Namespace) -> dict:
    from inferd import LLM
    from inferd.bench.prompts import synthetic_prompt
    from inferd.loader import load_model, resolve_model_path

    path = resolve_model_path(args.model)
    loaded = load_model(path, verbose=False, quantization=args.quantization)
    prompts = [synthetic_prompt(loaded.tokenizer, args.input_len, seed=i) for i in range(args.num_prompts)]
    llm = LLM(loaded=loaded, verbose=False, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1),
              max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=args.quantization)  # fmt: skip
    print(f"torch threads: {torch.get_num_threads()}, prompts: {args.num_prompts} × {args.input_len} "
          f"tokens, output: {args.output_len} tokens, runs: {args.runs}", file=sys.stderr)  # fmt: skip
    _inferd_run(llm, prompts[:2], 8)  # warm-up
    results: dict[str, list[RunResult]] = {"inferd": []}
    for i in range(args.runs):
        results["inferd"].append(_inferd_run(llm, prompts, args.output_len))
        print(f"inferd run {i + 1}: {results['inferd'][-1]}", file=sys.stderr)
    if "hf" in args.peers:
        if path.is_dir():
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         torch_dtype=torch.float32)  # fmt: skip
        model.eval()
        pad = loaded.tokenizer.eos_token_id or 0
        _hf_run(model, prompts[:2], 4, pad)  # warm-up
        results["hf"] = []
        for i in range(args.runs):
            results["hf"].append(_hf_run(model, prompts, args.output_len, pad))
            print(f"hf run {i + 1}: {results['hf'][-1]}", file=sys.stderr)

    report: dict = {"model": str(path), "quantization": args.quantization, "input_len": args.input_len, "output_len": args.output_len,
                    "num_prompts": args.num_prompts, "runs": args.runs, "engines": {}}  # fmt: skip
    for name, runs in results.items():
        report["engines"][name] = {
            f: round(_median(runs, f), 3)
            for f in ("single_decode_tps", "single_ttft_s", "batch_tps", "batch_seconds")
        }
    if "hf" in results:
        a, b = report["engines"]["inferd"], report["engines"]["hf"]
        report["ratio_vs_hf"] = {
            "single_decode": round(a["single_decode_tps"] / b["single_decode_tps"], 2),
            "batch": round(a["batch_tps"] / b["batch_tps"], 2),
        }
    print(f"\n{'engine':<8} {'1-stream decode tok/s':>22} {'TTFT s':>8} "
          f"{args.num_prompts}-request tok/s".rjust(20))  # fmt: skip
    for name, r in report["engines"].items():
        print(f"{name:<8} {r['single_decode_tps']:>22.1f} {r['single_ttft_s']:>8.3f} {r['batch_tps']:>20.1f}")
    if "ratio_vs_hf" in report:
        print(f"inferd / hf: single-stream {report['ratio_vs_hf']['single_decode']}×, "
              f"{args.num_prompts}-request {report['ratio_vs_hf']['batch']}×")  # fmt: skip
    print(json.dumps(report))
    return report


def add_offline_parser(sub) -> None:
    p = sub.add_parser("offline", help="offline API throughput (single stream + N requests) vs peers")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", "-q", default="none",
                   help="inferd's weights: none (fp32, what HF runs) or auto/int8/int4/fp8")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians (noisy machines)")
    p.add_argument("--peers", default="hf", help="comma list of peers to run alongside: hf, none")
    p.set_defaults(func=run_offline)
