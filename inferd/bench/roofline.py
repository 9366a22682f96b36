"""`inferd bench roofline`: the machine's own ceilings, and what a model's step costs against them.

Three ceilings (gpt-fast style: print what the hardware allows next to what was achieved):
- copy bandwidth, in the model's dtype: `dst.copy_(src)` over buffers far larger than the caches;
  bytes read + written.
- matrix-vector weight bandwidth, in the model's dtype: a [n, n] @ [n] product, weight bytes /
  time; in fp32 the faster of at::mv and inferd's own streaming kernel (csrc/dense_gemv.h), since
  a BLAS gemv can stream well below what the engine's decode reaches. This is what batch-1 decode
  does, so it is the bandwidth ceiling decode is judged against. The matrix is as large as the
  weights it stands for (`inferd bench latency` passes the model's bytes per step; alone, twice
  the last-level cache), since whether they stream from a cache or from DRAM sets the rate, and
  it sits in the same kind of memory as the engine's weights (`laid_out_as_weights`).
- matmul peak: 2·m·n·k / time of square products, on every path this CPU runs natively
  (`matmul_candidates`): fp32 always; bf16 / fp16 only with native instructions (AVX512-BF16,
  AVX512-FP16, AMX), since an emulated one is never the fastest; int8 with VNNI or AMX. Each path
  is timed with the op the engine runs for it where there is one (csrc/dense_gemv.h's tiles for
  fp32 prefill, the int8 VNNI tiles for quantized prefill, at::linear for bf16 / fp16), with
  torch's own op for that dtype and, for fp32, oneDNN from a packed weight, and keeps the fastest. The peak is the fastest path of all: prefill
  in any precision is judged against the best this CPU can do, never against a slower path than
  the one it ran (a ceiling below what the engine reaches would flatter it).

Each figure is the best of several timed repeats (a ceiling is an upper bound; noise only lowers
it). `StepCost` counts, from the built model, the weight bytes and FLOPs a forward pass needs, so
achieved GB/s and FLOP/s follow from a measured step time.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from inferd.kernels.build import cpu_flags
from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers import onednn_linear

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class MatmulPath:
    """One precision's matmul rate on this CPU: `name` is dtype and instruction set
    ("int8-VNNI"), `op` the call that reached `gflops` (2·m·n·k / s)."""

    name: str
    op: str
    gflops: float


@dataclass(frozen=True, slots=True)
class Roofline:
    dtype: str  # of the copy and matrix-vector ceilings
    threads: int
    copy_gbps: float  # (read + written) bytes / s of a large tensor copy
    matvec_gbps: float  # weight bytes / s of an [n, n] @ [n] product
    matmul: tuple[MatmulPath, ...]  # every native path measured, one per name

    @property
    def peak(self) -> MatmulPath:
        """The fastest matmul path: the compute ceiling of prefill and large-batch decode."""
        return max(self.matmul, key=lambda p: p.gflops)

    @property
    def matmul_gflops(self) -> float:
        return self.peak.gflops

    def as_dict(self) -> dict:
        d = {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()
             if k != "matmul"}  # fmt: skip
        d["matmul_gflops"] = round(self.peak.gflops, 2)
        d["matmul_peak_path"] = self.peak.name
        d["matmul_paths"] = {
            p.name: {"gflops": round(p.gflops, 2), "op": p.op} for p in self.matmul
        }
        return d

    def describe_peak(self) -> str:
        """The peak a prefill fraction is a fraction of: "<path> matmul peak (<rate> GFLOP/s)"."""
        return f"{self.peak.name} matmul peak ({self.peak.gflops:.1f} GFLOP/s)"


def _best_seconds(
    fn: Callable[[], object], repeats: int, budget_s: float, min_s: float = 0.0
) -> float:
    """The fastest call (after one warm-up): at least `repeats` calls and `min_s` seconds, at
    most `budget_s` seconds (a slow op stops early)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    calls = 0
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best, calls = min(best, t1 - t0), calls + 1
        if t1 - start > budget_s or (calls >= repeats and t1 - start >= min_s):
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


def laid_out_as_weights(w: torch.Tensor) -> torch.Tensor:
    """`w` moved where the engine keeps its weights (`weight_arena`: one block of 2 MiB pages,
    unless INFERD_WEIGHT_ARENA=0), so the bandwidth ceiling streams the same kind of pages a
    decode step does."""
    from inferd.layers.weight_arena import gather_weights

    holder = nn.Module()
    holder.weight = nn.Parameter(w, requires_grad=False)
    log = logging.getLogger("inferd.layers.weight_arena")
    level = log.level
    log.setLevel(logging.WARNING)  # its "weights: ... MB in one block" is about a model's
    try:
        gather_weights([holder])
    finally:
        log.setLevel(level)
    return holder.weight.data


def _time_matvec(n: int, dtype: torch.dtype, repeats: int, budget_s: float) -> float:
    """The faster of at::mv and, in fp32, inferd's streaming kernel over an [n, n] weight."""
    w = laid_out_as_weights(torch.randn(n, n).to(dtype))
    x = torch.randn(n).to(dtype)
    t = _best_seconds(lambda: torch.mv(w, x), repeats, budget_s)
    ext = cpu_kernels() if dtype == torch.float32 else None
    if ext is not None:
        x1 = x.view(1, n)
        t = min(t, _best_seconds(lambda: ext.dense_linear(x1, w, None), repeats, budget_s))
    return t


def native_paths(flags: set[str]) -> dict[str, str]:
    """dtype → the path name of each precision this CPU multiplies natively (its /proc/cpuinfo
    flags): fp32 always; bf16, fp16 and int8 only with instructions of their own."""
    paths = {"fp32": "fp32"}
    if "amx_bf16" in flags:
        paths["bf16"] = "bf16-AMX"
    elif "avx512_bf16" in flags:
        paths["bf16"] = "bf16-AVX512"
    if "amx_fp16" in flags:
        paths["fp16"] = "fp16-AMX"
    elif "avx512_fp16" in flags:
        paths["fp16"] = "fp16-AVX512"
    if "amx_int8" in flags:
        paths["int8"] = "int8-AMX"
    elif flags & {"avx512_vnni", "avx_vnni"}:
        paths["int8"] = "int8-VNNI"
    return paths


Candidate = tuple[str, str, Callable[[], object]]  # (path name, op, call)


def matmul_candidates(n: int, flags: set[str] | None = None) -> list[Candidate]:
    """(path name, op, call) of each [n, n] @ [n, n] product to time on this CPU (`flags`: its
    /proc/cpuinfo flags). An op that fails to run here (a build without it) is left out."""
    flags = set(cpu_flags().split()) if flags is None else flags
    paths = native_paths(flags)
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    out: list[Candidate] = [("fp32", "at::mm", lambda: torch.mm(a, w))]
    ext = cpu_kernels()
    if ext is not None:  # what inferd's `Linear` runs at every row count
        out.append(("fp32", "inferd dense", functools.partial(ext.dense_linear, a, w)))
    if onednn_linear.available():  # the fastest fp32 sgemm PyTorch has on AMD CPUs
        packed = onednn_linear.pack(w)
        out.append(("fp32", "oneDNN packed", lambda: onednn_linear.linear_packed(a, packed)))
    for dtype, half in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if dtype in paths:  # oneDNN takes AMX where the CPU has it
            ah, wh = a.to(half), w.to(half)
            call = functools.partial(torch.nn.functional.linear, ah, wh)
            out.append((paths[dtype], "at::linear", call))
    if "int8" in paths:
        if ext is not None and ext.has_int8_gemm:  # quantized prefill: x rounded to int8 per call
            from inferd.quantization.formats import quantize_int8_blocks

            q = quantize_int8_blocks(w)
            tiles = ext.pack_int8_tiles(q.data, q.scales, q.mins, q.group)
            call = functools.partial(ext.tiles_linear, a, *tiles, True)
            out.append(("int8-VNNI", "inferd int8 tiles", call))
        ai = torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=gen)
        wi = torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=gen)
        out.append((paths["int8"], "torch._int_mm", lambda: torch._int_mm(ai, wi)))
    runnable = []
    for name, op, call in out:
        try:
            call()
        except (RuntimeError, AttributeError, NotImplementedError):
            continue
        runnable.append((name, op, call))
    return runnable


def measure_matmul(
    n: int = 1024, repeats: int = 10, budget_s: float = 3.0, flags: set[str] | None = None
) -> tuple[MatmulPath, ...]:
    """Each native path's best rate over [n/2]² and [n]² products (the smaller one fits in the
    quiet moments of a loaded machine, the larger keeps many cores busy); per path the faster of
    its ops. Each op is timed for `budget_s` / 8 to / 4 seconds."""
    best: dict[str, MatmulPath] = {}
    for size in sorted({max(64, n // 2), n}):
        for name, op, call in matmul_candidates(size, flags):
            t = _best_seconds(call, repeats, budget_s / 4, min_s=budget_s / 8)
            path = MatmulPath(name, op, 2 * size**3 / t / 1e9)
            if name not in best or path.gflops > best[name].gflops:
                best[name] = path
    return tuple(best.values())


def measure_roofline(
    dtype: torch.dtype = torch.float32,
    copy_mib: int = 256,
    matvec_n: int | None = None,
    matmul_n: int = 1024,
    repeats: int = 10,
    budget_s: float = 3.0,
) -> Roofline:
    """Measure the ceilings: copy and matrix-vector in `dtype`, each native matmul path.
    `matvec_n` None: twice the last-level cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    if matvec_n is None:
        matvec_n = matvec_n_for(2 * last_level_cache_bytes(), dtype)
    n_copy = (copy_mib << 20) // elem
    t_copy = _time_copy(n_copy, dtype, repeats, budget_s)
    t_mv = _time_matvec(matvec_n, dtype, repeats * 5, budget_s)
    return Roofline(
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        copy_gbps=2 * n_copy * elem / t_copy / 1e9,
        matvec_gbps=matvec_n * matvec_n * elem / t_mv / 1e9,
        matmul=measure_matmul(matmul_n, repeats, budget_s),
    )


def best_of(a: Roofline, b: Roofline) -> Roofline:
    """Each ceiling, and each matmul path, at its higher measurement (noise from other jobs only
    ever lowers one)."""
    paths = {p.name: p for p in a.matmul}
    for p in b.matmul:
        if p.name not in paths or p.gflops > paths[p.name].gflops:
            paths[p.name] = p
    return Roofline(a.dtype, a.threads, max(a.copy_gbps, b.copy_gbps),
                    max(a.matvec_gbps, b.matvec_gbps), tuple(paths.values()))  # fmt: skip


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
    expert_bytes: a mixture's routed experts, all layers (not in weight_bytes): a step reads
        the experts its tokens chose, `top_k` of `num_experts` per token per layer. At batch B
        that is, routing uniformly, a 1 - (1 - k/E)^B share of them (exactly k/E at batch 1);
        linear_flops_per_token counts a token's k experts.
    """

    weight_bytes: int
    linear_flops_per_token: int
    attn_flops_per_context_token: int
    kv_bytes_per_token: int
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0

    def weight_bytes_read(self, batch: int) -> int:
        """Weight bytes a step of `batch` rows reads (the experts they route to, in expectation)."""
        if not self.num_experts:
            return self.weight_bytes
        share = 1 - (1 - self.top_k / self.num_experts) ** batch
        return self.weight_bytes + round(self.expert_bytes * share)

    def decode_step(self, context_lens: list[int]) -> tuple[int, int]:
        """(bytes read, FLOPs) of one decode step of sequences with these context lengths."""
        ctx = sum(context_lens)
        bytes_read = self.weight_bytes_read(len(context_lens)) + ctx * self.kv_bytes_per_token
        flops = (
            len(context_lens) * self.linear_flops_per_token
            + ctx * self.attn_flops_per_context_token
        )
        return bytes_read, flops

    def prefill_flops(self, prompt_lens: list[int]) -> int:
        """FLOPs of prefilling these prompts (causal attention: token i sees i + 1 keys)."""
        attn = sum(n * (n + 1) // 2 for n in prompt_lens) * self.attn_flops_per_context_token
        return sum(prompt_lens) * self.linear_flops_per_token + attn


def step_cost(
    model: nn.Module, kv_bytes_per_token: int, bytes_per_weight: float | None = None
) -> StepCost:
    """The model's `StepCost` with its weights as stored, or at `bytes_per_weight` for every
    matmul weight (what a peer that holds the same model in another precision reads per step)."""
    from inferd.layers.linear import Linear
    from inferd.layers.moe import SparseMoE
    from inferd.layers.norm import RMSNorm
    from inferd.layers.quantized_linear import QuantizedLinear

    cfg = model.config
    # A mixture's routed experts: counted apart (a step reads only those its tokens chose).
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE)
               for m in moe.experts.modules()}  # fmt: skip
    expert_bytes = expert_flops = 0
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
        if bytes_per_weight is not None:
            nbytes = round(out_f * in_f * bytes_per_weight)
        if m.bias is not None:
            nbytes += m.bias.numel() * m.bias.element_size()
        if id(m) in experts:
            expert_flops += 2 * out_f * in_f
            expert_bytes += nbytes
            continue
        linear_flops += 2 * out_f * in_f
        if key not in seen:  # the same matrix in two modules is still one read per step
            seen.add(key)
            weight_bytes += nbytes
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e:
        linear_flops += expert_flops * k // e
    return StepCost(weight_bytes, linear_flops, attn, kv_bytes_per_token, expert_bytes, e, k)


def engine_step_cost(engine) -> StepCost:
    """The `StepCost` of an `EngineCore`'s model as it runs: weights as stored, KV in the
    engine's `--kv-cache-dtype` (scales included)."""
    from inferd.kv.kv_cache import kv_bytes_per_token

    kv = kv_bytes_per_token(engine.model_config, engine.dtype, engine.config.cache.kv_cache_dtype)
    return step_cost(engine.runner.model, kv)


def run_roofline(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    roof = measure_roofline(_DTYPES[args.dtype], copy_mib=args.copy_mib, matvec_n=args.matvec_n,
                            matmul_n=args.matmul_n, budget_s=args.budget_s)  # fmt: skip
    report: dict = {"roofline": roof.as_dict()}
    paths = ", ".join(f"{p.name} {p.gflops:.1f} ({p.op})" for p in roof.matmul)
    print(f"{roof.dtype}, {roof.threads} threads: copy {roof.copy_gbps:.1f} GB/s · matrix-vector "
          f"{roof.matvec_gbps:.1f} GB/s of weights · {roof.describe_peak()}; matmul GFLOP/s by "
          f"path: {paths}")  # fmt: skip
    if args.model_limits:
        from inferd import LLM

        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                  kv_cache_memory=64 << 20, verbose=False)  # fmt: skip
        cost = engine_step_cost(llm.engine)
        report["model"] = model_limits(cost, roof)
        m = report["model"]
        print(f"model ({args.quantization}): {m['weight_mb']:.1f} MB of weights read and "
              f"{m['mflop_per_token']:.1f} MFLOP per token → batch-1 bandwidth limit "
              f"{m['bandwidth_limit_tps']:.1f} tok/s, compute limit "
              f"{m['compute_limit_tps']:.1f} tok/s ({m['compute_limit_path']})")  # fmt: skip
    print(json.dumps(report))
    return report


def model_limits(cost: StepCost, roof: Roofline) -> dict:
    """Batch-1 decode bound by weight reads, and large-batch throughput bound by the matmul peak
    (attention over a short context left out: both are ceilings)."""
    return {
        "weight_mb": round(cost.weight_bytes / 1e6, 1),
        "mflop_per_token": round(cost.linear_flops_per_token / 1e6, 1),
        "bandwidth_limit_tps": round(roof.matvec_gbps * 1e9 / cost.weight_bytes, 1),
        "compute_limit_tps": round(roof.matmul_gflops * 1e9 / cost.linear_flops_per_token, 1),
        "compute_limit_path": roof.peak.name,
    }


def add_roofline_parser(sub) -> None:
    p = sub.add_parser("roofline", help="the machine's copy / matrix-vector bandwidth and the "
                       "matmul rate of each native path")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--matvec-n", type=int, default=None,
                   help="matrix-vector size (default: twice the last-level cache)")  # fmt: skip
    p.add_argument("--matmul-n", type=int, default=1024,
                   help="matmul peak over [n/2]² and [n]² products")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=3.0, help="seconds per measurement at most")
    p.add_argument("--model-limits", action="store_true",
                   help="also load --model and print its bandwidth / compute limits "
                        "in tokens/s")  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", "-q", default="none", help="of --model (--model-limits)")
    p.set_defaults(func=run_roofline)
