"""What every bench shares: latency percentiles in ms, and the model / peers flags."""

from __future__ import annotations

import argparse

import numpy as np
import torch


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of durations given in seconds, in milliseconds."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def cpu_kernels_report() -> dict[str, bool | str]:
    """Whether inferd's CPU kernels are loaded, and the prefetch hint they stream weights with.
    Why: where they fail to build the engine runs the PyTorch path after one line on stderr, which
    a bench's figures alone would hide (the PyTorch path decodes fp32 at a fraction of the
    kernels' speed)."""
    from inferd.kernels.quant_gemm import extension, stream_prefetch_hint

    return {"cpu_kernels": extension() is not None, "stream_prefetch": stream_prefetch_hint()}


def add_model_args(p: argparse.ArgumentParser, peers: bool = True) -> None:
    """--model, --dtype, --quantization (fp32 by default: the precision HF runs), --threads,
    --peers."""
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", "-q", default="none",
                   help="inferd's weights: none (fp32, what HF runs) or auto/int8/int4/fp8")  # fmt: skip
    add_threads_arg(p)
    if peers:
        p.add_argument("--peers", default="hf,llama.cpp",
                       help="comma list: hf, llama.cpp, openvino (each skipped with a note when not "
                            "installed), none")  # fmt: skip


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads, which llama.cpp uses too (0: torch's default); on a loaded "
                        "machine fewer threads than cores avoid OpenMP's oversubscription collapse")  # fmt: skip


def set_threads(n: int) -> None:
    """Every engine of a bench runs with the same thread count (llama.cpp reads torch's)."""
    if n < 0:
        raise ValueError(f"--threads must be ≥ 0, got {n}")
    if n:
        torch.set_num_threads(n)
