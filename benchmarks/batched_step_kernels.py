"""The kernels of a batched CPU step, timed alone on one thread: the int8 tile GEMM's multiply-add
rate by row count, and paged attention's time per layer for a decode batch, a prefill chunk and a
verification.

    python benchmarks/batched_step_kernels.py [--ext PATH/inferd_cpu_kernels.so] [--out FILE]

Times are the best of 7 rounds of process CPU time (`time.process_time`), not wall time: on a
shared, oversubscribed machine the wall clock mostly measures the other jobs. `--ext` loads a
given build of csrc/cpu_kernels.cpp (one from the kernel cache of another checkout: before and
after a change, in alternating processes); `--out` saves the attention outputs, so two builds can
be checked for the same bits (`torch.equal`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's inferd


def load(path: str | None):
    if path is None:
        from inferd.kernels.quant_gemm import extension

        return extension()
    spec = importlib.util.spec_from_file_location("inferd_cpu_kernels", path)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext


def best_seconds(fn, rounds: int = 7, budget_s: float = 0.3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start, n = time.process_time(), 0
        while time.process_time() - start < budget_s:
            fn()
            n += 1
        best = min(best, (time.process_time() - start) / n)
    return best


def gemm_rates(ext, n: int, k: int) -> dict:
    from inferd.quantization import formats

    rates = {}
    for fmt in ("int4", "int8"):
        w = formats.pack_tiles(formats.quantize(torch.randn(n, k), fmt))
        if w is None:  # no VNNI tiles in this build
            continue
        mins = w.mins if w.mins is not None else torch.empty(0)
        for m in (1, 8, 32, 128, 512):
            x = torch.randn(m, k)
            s = best_seconds(lambda x=x, w=w, mins=mins: ext.tiles_linear(x, w.data, w.scales, mins, False))
            rates[f"{fmt} M={m}"] = round(m * n * k / s / 1e9, 1)
    return rates


# (sequences, context, queries per sequence): 32 decodes, one 512-token prefill, 4 verifications
ATTENTION_SHAPES = ((32, 192, 1), (1, 512, 512), (4, 256, 4))


def attention_ms(ext, outs: dict) -> dict:
    hq, hkv, d, bs = 9, 3, 64, 16  # the default model's heads
    times = {}
    for b, ctx, nq in ATTENTION_SHAPES:
        g = torch.Generator().manual_seed(0)
        blocks = b * -(-ctx // bs)
        q = torch.randn(b * nq, hq, d, generator=g)
        out = torch.empty_like(q)
        tables = torch.randperm(blocks + 64, generator=g)[:blocks].view(b, -1).contiguous()
        k = torch.randn(blocks + 64, bs, hkv, d, generator=g)
        v = torch.randn(blocks + 64, bs, hkv, d, generator=g)
        args = (torch.arange(b) * nq, torch.full((b,), nq), torch.full((b,), ctx), tables, out, d**-0.5)
        name = f"{b} seqs x {nq} queries, context {ctx}"
        call = lambda q=q, k=k, v=v, args=args: ext.paged_attention_short(q, k, v, *args)
        times[name] = round(best_seconds(call) * 1e3, 3)
        outs[name] = out.clone()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ext", help="a built inferd_cpu_kernels.so (default: this checkout's)")
    p.add_argument("--out", help="save the attention outputs here (torch.save)")
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--k", type=int, default=576)
    args = p.parse_args()
    torch.set_num_threads(1)
    ext = load(args.ext)
    outs: dict = {}
    report = {"ext": args.ext or "this checkout", "attention_ms_per_layer": attention_ms(ext, outs)}
    if args.ext is None:
        report[f"tile_gemm_gmac_per_s [{args.n}, {args.k}]"] = gemm_rates(ext, args.n, args.k)
    if args.out:
        torch.save(outs, args.out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
