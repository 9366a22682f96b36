"""Batch-1 decode speed of each --quantization mode on the same model, side by side in one run.

    python -m inferd.quantization.bench [--model M] [--modes none,int8,int4,auto] [--tokens 128]

Decode on a CPU is bound by the weight bytes read per token, so next to tokens/s it prints the
weight bytes streamed per second. Runs interleave the modes (noisy machines hit all alike) and
report medians; the last line is one JSON document with the ratios to "none" (fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

PROMPT = "The history of the Roman Empire began when a small settlement on the Tiber river grew"


def decode_tps(llm, prompt_ids: list[int], tokens: int) -> float:
    from inferd import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)


def main(argv: list[str] | None = None) -> None:
    from inferd import LLM
    from inferd.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--modes", default="none,int8,int4,auto")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    loaded = load_model(args.model, quantization="auto")
    dense = None
    llms = {}
    for mode in args.modes.split(","):
        src = loaded
        if mode in ("int8", "int4", "fp8"):  # quantize the fp32 weights, as a user of HF fp32 would
            from inferd.quantization.formats import dequantize

            if dense is None:
                dense = type(loaded)(loaded.config, {k: dequantize(v) for k, v in loaded.weights.items()},
                                     loaded.tokenizer, loaded.source, loaded.file_type)  # fmt: skip
            src = dense
        llms[mode] = LLM(loaded=src, quantization=mode, kv_cache_memory=64 << 20, verbose=False)
    ids = loaded.tokenizer.encode(PROMPT)
    for llm in llms.values():
        decode_tps(llm, ids, 8)  # warm-up (and the kernels' first build)
    runs: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(args.runs):
        for mode, llm in llms.items():
            runs[mode].append(decode_tps(llm, ids, args.tokens))
    print(f"torch threads {torch.get_num_threads()}, {args.tokens} tokens, median of {args.runs}")
    report = {"model": loaded.source, "threads": torch.get_num_threads(), "modes": {}}
    for mode, llm in llms.items():
        tps = statistics.median(runs[mode])
        wb = llm.engine.weight_bytes
        report["modes"][mode] = {"decode_tps": round(tps, 2), "weight_mib": round(wb / 2**20, 1),
                                 "weight_gbps": round(tps * wb / 1e9, 2)}  # fmt: skip
        print(f"{mode:<6} {tps:7.1f} tok/s  weights {wb / 2**20:7.1f} MiB  "
              f"{tps * wb / 1e9:6.1f} GB/s of weights")  # fmt: skip
    if "none" in report["modes"]:
        base = report["modes"]["none"]["decode_tps"]
        report["ratio_vs_fp32"] = {m: round(r["decode_tps"] / base, 2)
                                   for m, r in report["modes"].items()}  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
