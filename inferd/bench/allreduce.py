"""`inferd bench allreduce`: the tensor-parallel all-reduce between ranks on this host, through
gloo and through shared memory (inferd/distributed/shm_allreduce.py), side by side in the same
processes, at the sizes a layer sends (hidden-size rows); each size's results checked equal."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as tmp


def _percentiles(ts: list[float]) -> dict[str, float]:
    ts = sorted(ts)
    return {f"p{q}_us": round(ts[len(ts) * q // 100] * 1e6, 1) for q in (10, 50, 90)}


def _rank(rank: int, world: int, port: int, name: str, sizes: list[int], iters: int, out) -> None:
    from inferd.distributed.group import TPGroup

    torch.set_num_threads(1)
    group = TPGroup(rank, world, "127.0.0.1", port, torch.device("cpu"), name, max(sizes) * 4)
    report = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        row: dict = {"floats": n}
        results = {}
        # Interleaved call by call: load from other jobs hits both alike.
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        for i in range(iters + 20):
            for label, fn in (("gloo", group.all_reduce_gloo), ("shm", group.all_reduce)):
                y = x.clone()
                t = time.perf_counter()
                results[label] = fn(y)
                if i >= 20:  # warm-up first
                    times[label].append(time.perf_counter() - t)
        for label, ts in times.items():
            row[label] = _percentiles(ts)
        row["equal"] = bool(torch.equal(results["gloo"], results["shm"]))
        report.append(row)
    if rank == 0:
        out.put(report)
    group.close()


def run_allreduce(args: argparse.Namespace) -> dict:
    from inferd.distributed.executor import free_port
    from inferd.distributed.shm_allreduce import ShmAllReduce

    ctx = tmp.get_context("spawn")
    out = ctx.SimpleQueue()
    tmp.spawn(_rank, args=(args.ranks, free_port(), ShmAllReduce.create_name(), args.sizes,
                           args.iters, out), nprocs=args.ranks)  # fmt: skip
    rows = out.get()
    print(
        f"{'floats':>8} {'gloo p50':>9} {'p10':>7} {'p90':>7} {'shm p50':>8} {'p10':>7} {'p90':>7} same bits"
    )
    for r in rows:
        g, s = r["gloo"], r["shm"]
        print(f"{r['floats']:>8} {g['p50_us']:>7.1f}µs {g['p10_us']:>7.1f} {g['p90_us']:>7.1f} "
              f"{s['p50_us']:>6.1f}µs {s['p10_us']:>7.1f} {s['p90_us']:>7.1f} {r['equal']}")  # fmt: skip
    report = {"bench": "allreduce", "ranks": args.ranks, "iters": args.iters, "sizes": rows}
    print(json.dumps(report))
    return report


def add_allreduce_parser(sub) -> None:
    p = sub.add_parser(
        "allreduce", help="tensor-parallel all-reduce on this host: gloo vs shared memory"
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[576, 640, 2048, 65536],
                   help="floats per all-reduce (a hidden-size row: 576 SmolLM2, 640 Gemma 3 270M)")  # fmt: skip
    p.add_argument("--iters", type=int, default=500)
    p.set_defaults(func=run_allreduce)
