"""Tile sweep of the Triton weight-only GEMMs on a GPU: for each format and shape, the time of each
(BLOCK_N, BLOCK_K, SPLIT_K) against `launch_config`'s choice, checked against the reference.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_sweep_quant_gemm.py [--budget-s 240] [--out DIR]

Run from the repository root on a CUDA machine with triton. Writes sweep.json to --out ($OUT).
What it finds feeds `inferd/kernels/triton/quant_gemm.py:launch_config`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from inferd.kernels.triton import quant_gemm as qg
from inferd.kernels.triton import selfcheck

SHAPES = [(1, 14336, 4096), (1, 4096, 14336), (32, 14336, 4096)]
FORMATS = ["int4", "int8", "fp8"]
BLOCK_N = [32, 64, 128]
BLOCK_K = [64, 128, 256]
SPLIT_K = [1, 4, 16]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_sweep_out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    started = time.monotonic()
    default_config = qg.launch_config
    results = []
    for fmt, (m, n, k) in itertools.product(FORMATS, SHAPES):
        base = selfcheck.check_quant_gemm(device, m, n, k, fmt)
        chosen = default_config(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count)
        row = {"fmt": fmt, "shape": [m, n, k], "default": {**chosen, "ms": base["ms"], "gbps": base["gbps"]},
               "best": None, "tried": 0}  # fmt: skip
        for bn, bk, split in itertools.product(BLOCK_N, BLOCK_K, SPLIT_K):
            if time.monotonic() - started > args.budget_s:
                break
            if k % (bk * split) or (fmt == "int4" and bk < 32):
                continue
            cfg = {"BLOCK_M": chosen["BLOCK_M"], "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}
            qg.launch_config = lambda *a, cfg=cfg: dict(cfg)
            try:
                r = selfcheck.check_quant_gemm(device, m, n, k, fmt)
            except Exception as e:  # noqa: BLE001 (a configuration the compiler refuses)
                print(f"{fmt} {m}x{n}x{k} {cfg}: {type(e).__name__}", flush=True)
                continue
            finally:
                qg.launch_config = default_config
            row["tried"] += 1
            if r["rel_err"] > 2e-2:
                print(f"{fmt} {m}x{n}x{k} {cfg}: rel_err {r['rel_err']:.1e} (wrong)", flush=True)
                continue
            if row["best"] is None or r["ms"] < row["best"]["ms"]:
                row["best"] = {**cfg, "ms": r["ms"], "gbps": r["gbps"]}
        results.append(row)
        best = row["best"] or {}
        print(f"{fmt} {m}x{n}x{k}: default {row['default']} -> best {best} ({row['tried']} tried)", flush=True)
        (out / "sweep.json").write_text(json.dumps(results, indent=1))
        if time.monotonic() - started > args.budget_s:
            print("budget spent", flush=True)
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
