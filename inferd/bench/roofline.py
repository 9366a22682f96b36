"""`inferd bench roofline`: the machine's own ceilings, and what a model's step costs against them.

Three ceilings, measured in the model's dtype (gpt-fast style: print what the hardware allows next
to what was achieved):
- copy bandwidth: `dst.copy_(src)` over buffers far larger than the caches; bytes read + written.
- matrix-vector weight bandwidth: a [n, n] @ [n] product, weight bytes / time (in fp32 the faster
  of at::mv and inferd's own streaming kernel, csrc/dense_gemv.h: MKL's reached 26 GB/s on an
  AVX-512 EPYC where the fp32 decode step read its weights at ~46). This is what
  batch-1 decode does, so it is the bandwidth ceiling decode is judged against. The matrix is as
  large as the weights it stands for (`inferd bench latency` passes the model's bytes per step;
  alone, twice the last-level cache): a fixed 4096² (64 MB) one sat in a 260 MB L3 and read at
  ~49 GB/s, while 538 MB of fp32 weights stream from DRAM at ~30.
- matmul FLOP/s: a square [n, n] @ [n, n] product, 2·n³ / time: the compute ceiling of prefill
  and large-batch decode. In fp32 the faster of at::mm (MKL) and oneDNN from a packed weight (what
  inferd's many-row `Linear` runs): on an AVX-512 EPYC MKL reached 218 GFLOP/s and oneDNN ~500, and
  a ceiling below what the engine itself reaches would flatter it.

Each is the best of several timed repeats (a ceiling is an upper bound; noise only lowers it).
`StepCost` counts, from the built model, the weight bytes and FLOPs a forward pass needs, so
achieved GB/s and FLOP/s follow from a measured step time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers import onednn_linear

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Roofline:
    dtype: str
    threads: int
    copy_gbps: float  # (read + written) bytes / s of a large tensor copy
    matvec_gbps: float  # weight bytes / s of an [n, n] @ [n] product
    matmul_gflops: float  # 2·n³ / s of an [n, n] @ [n, n] product

    def as_dict(self) -> dict:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _best_seconds(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """The fastest of `repeats` calls (after one warm-up), stopping early past `budget_s`."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return best


def _time_copy(n: int, dtype: torch.dtype, repeats: int, budget_s: float) -> float:
    src = torch.ones(n, dtype=dtype)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), repeats, budget_s)


def last_level_cache_bytes() -> int:
    """The largest CPU cache (sysfs), or 32 MiB where the kernel does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def matvec_n_for(nbytes: int, dtype: torch.dtype = torch.float32) -> int:
    """The n of an [n, n] matrix of at least `nbytes` (and 4096 at least)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return max(4096, math.ceil(math.sqrt(nbytes / elem)))


def _time_op(
    op, shape_a: tuple, shape_b: tuple, dtype: torch.dtype, repeats: int, budget_s: float
) -> float:
    a = torch.randn(shape_a).to(dtype)
    b = torch.randn(shape_b).to(dtype)
    return _best_seconds(lambda: op(a, b), repeats, budget_s)


def measure_roofline(
    dtype: torch.dtype = torch.float32,
    copy_mib: int = 256,
    matvec_n: int | None = None,
    matmul_n: int = 1024,
    repeats: int = 10,
    budget_s: float = 3.0,
) -> Roofline:
    """Measure the three ceilings; ~`3 × budget_s` seconds at most (bf16 matmul on CPUs without
    native bf16 is slow: the budget bounds it). `matvec_n` None: twice the last-level cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    if matvec_n is None:
        matvec_n = matvec_n_for(2 * last_level_cache_bytes(), dtype)
    n_copy = (copy_mib << 20) // elem
    t_copy = _time_copy(n_copy, dtype, repeats, budget_s)
    t_mv = _time_op(torch.mv, (matvec_n, matvec_n), (matvec_n,), dtype, repeats * 5, budget_s)
    ext = cpu_kernels() if dtype == torch.float32 else None
    if ext is not None:
        t_mv = min(t_mv, _time_op(ext.dense_linear, (1, matvec_n), (matvec_n, matvec_n), dtype,
                                  repeats * 5, budget_s))  # fmt: skip
    t_mm = _time_op(torch.mm, (matmul_n, matmul_n), (matmul_n, matmul_n), dtype, repeats, budget_s)
    if dtype == torch.float32 and onednn_linear.available():
        w = onednn_linear.pack(torch.randn(matmul_n, matmul_n))
        t_mm = min(t_mm, _time_op(lambda a, _: onednn_linear.linear_packed(a, w), (matmul_n, matmul_n),
                                  (1,), dtype, repeats, budget_s))  # fmt: skip
    return Roofline(
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        copy_gbps=2 * n_copy * elem / t_copy / 1e9,
        matvec_gbps=matvec_n * matvec_n * elem / t_mv / 1e9,
        matmul_gflops=2 * matmul_n**3 / t_mm / 1e9,
    )


def best_of(a: Roofline, b: Roofline) -> Roofline:
    """Each ceiling at its higher measurement (noise from other jobs only ever lowers one)."""
    return Roofline(a.dtype, a.threads, max(a.copy_gbps, b.copy_gbps),
                    max(a.matvec_gbps, b.matvec_gbps), max(a.matmul_gflops, b.matmul_gflops))  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one forward pass of a model needs, counted from its layers.

    weight_bytes: bytes of every matmul weight (packed size for quantized ones) and norm; each
        forward reads all of them once, whatever the batch (a tied embedding is read as the
        output head; an untied one only looks up rows, so it is not counted).
    linear_flops_per_token: 2 · Σ in·out over the matmuls.
    attn_flops_per_context_token: 4 · layers · heads · head_dim: QKᵀ and PV of one query row
        against one cached key.
    kv_bytes_per_token: K and V of one cached token, all layers (read by each decode step).
    """

    weight_bytes: int
    linear_flops_per_token: int
    attn_flops_per_context_token: int
    kv_bytes_per_token: int

    def decode_step(self, context_lens: list[int]) -> tuple[int, int]:
        """(bytes read, FLOPs) of one decode step of sequences with these context lengths."""
        ctx = sum(context_lens)
        bytes_read = self.weight_bytes + ctx * self.kv_bytes_per_token
        flops = (
            len(context_lens) * self.linear_flops_per_token
            + ctx * self.attn_flops_per_context_token
        )
        return bytes_read, flops

    def prefill_flops(self, prompt_lens: list[int]) -> int:
        """FLOPs of prefilling these prompts (causal attention: token i sees i + 1 keys)."""
        attn = sum(n * (n + 1) // 2 for n in prompt_lens) * self.attn_flops_per_context_token
        return sum(prompt_lens) * self.linear_flops_per_token + attn


def step_cost(model: nn.Module, kv_bytes_per_token: int) -> StepCost:
    from inferd.layers.linear import Linear
    from inferd.layers.norm import RMSNorm
    from inferd.layers.quantized_linear import QuantizedLinear

    cfg = model.config
    weight_bytes = 0
    linear_flops = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, Linear):
            key, nbytes = id(m.weight), m.weight.numel() * m.weight.element_size()
            out_f, in_f = m.weight.shape
        elif isinstance(m, QuantizedLinear):
            key, nbytes = id(m.qweight), m.weight_nbytes
            out_f, in_f = m.out_features, m.in_features
        elif isinstance(m, RMSNorm):
            weight_bytes += m.weight.numel() * m.weight.element_size()
            continue
        else:
            continue
        linear_flops += 2 * out_f * in_f
        if key not in seen:  # the same matrix in two modules is still one read per step
            seen.add(key)
            weight_bytes += nbytes
        if m.bias is not None:
            weight_bytes += m.bias.numel() * m.bias.element_size()
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return StepCost(weight_bytes, linear_flops, attn, kv_bytes_per_token)


def engine_step_cost(engine) -> StepCost:
    """The `StepCost` of an `EngineCore`'s model in its compute dtype."""
    model = engine.runner.model
    return step_cost(model, engine.model_config.kv_bytes_per_token(engine.dtype))


def run_roofline(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    roof = measure_roofline(_DTYPES[args.dtype], copy_mib=args.copy_mib, matvec_n=args.matvec_n,
                            matmul_n=args.matmul_n, budget_s=args.budget_s)  # fmt: skip
    report: dict = {"roofline": roof.as_dict()}
    print(f"{roof.dtype}, {roof.threads} threads: copy {roof.copy_gbps:.1f} GB/s · "
          f"matrix-vector {roof.matvec_gbps:.1f} GB/s of weights · matmul {roof.matmul_gflops:.1f} GFLOP/s")  # fmt: skip
    if args.model_limits:
        from inferd import LLM

        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                  kv_cache_memory=64 << 20, verbose=False)  # fmt: skip
        cost = engine_step_cost(llm.engine)
        report["model"] = model_limits(cost, roof)
        m = report["model"]
        print(f"model ({args.quantization}): {m['weight_mb']:.1f} MB of weights read and "
              f"{m['mflop_per_token']:.1f} MFLOP per token → batch-1 bandwidth limit "
              f"{m['bandwidth_limit_tps']:.1f} tok/s, compute limit {m['compute_limit_tps']:.1f} tok/s")  # fmt: skip
    print(json.dumps(report))
    return report


def model_limits(cost: StepCost, roof: Roofline) -> dict:
    """Batch-1 decode bound by weight reads, and large-batch throughput bound by matmul FLOP/s
    (attention over a short context left out: both are ceilings)."""
    return {
        "weight_mb": round(cost.weight_bytes / 1e6, 1),
        "mflop_per_token": round(cost.linear_flops_per_token / 1e6, 1),
        "bandwidth_limit_tps": round(roof.matvec_gbps * 1e9 / cost.weight_bytes, 1),
        "compute_limit_tps": round(roof.matmul_gflops * 1e9 / cost.linear_flops_per_token, 1),
    }


def add_roofline_parser(sub) -> None:
    p = sub.add_parser(
        "roofline", help="the machine's copy / matrix-vector bandwidth and matmul FLOP/s"
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--matvec-n", type=int, default=None,
                   help="matrix-vector size (default: twice the last-level cache)")
    p.add_argument("--matmul-n", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=3.0, help="seconds per measurement at most")
    p.add_argument("--model-limits", action="store_true",
                   help="also load --model and print its bandwidth / compute limits in tokens/s")  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", "-q", default="none", help="of --model (--model-limits)")
    p.set_defaults(func=run_roofline)
