"""One prepared run that checks inferd on a GPU: kernels, engine parity, step times, memory plan.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [--device cuda] [--budget-s 330] [--quick]

Run from the repository root (a source checkout: `inferd` and `tests/` are imported from the tree).
Sections, each skipped with a line when the time budget is spent or what it needs is missing:

  environment   Python / torch / triton / transformers versions, GPU name, free memory, the
                device-to-device copy bandwidth (the figure kernel GB/s are read against)
  triton        inferd/kernels/triton/selfcheck.py, where present: paged attention at batch
                1/32/128, contexts to 8k, GQA 32/8, head_dim 128; quantized GEMMs 4096x14336
  parity        a seeded tiny Llama-shaped GGUF written by tests/tiny_models.py: greedy tokens
                (fp32) equal benchmarks/gpu_reference.json, computed on a CPU
  speculation   the same prompts with n-gram speculation: tokens equal plain greedy
  memory_plan   the engine's plan after load (weights, activations, KV pool) against free memory
  step_time     an 8B-shaped bf16 Llama built in memory on the device: decode step time at batch
                1/8/32 against the weight-bytes bandwidth limit, the engine's CUDA graphs against
                enforce_eager=True
  syncs         host syncs (CUDA sync debug mode), device->host readbacks and kernel launches of
                one decode step as the engine runs it by default (a CUDA graph replay)
  cuda_graphs   one decode step's forward of that model, eager against a CUDA graph replay of it

Output: progress lines on stdout; `summary.json` and `summary.md` in $OUT (default ./gpu_check_out),
rewritten after every section so a run cut short still leaves what it measured. `--device cpu
--quick` is the dry run the test suite does (small shapes, a few steps).

Packages it needs beyond torch (2.11+), numpy, safetensors, tokenizers, jinja2, psutil, tqdm:
  gguf==0.19.0 (pure Python; tests/tiny_models.py writes the GGUF with it) and its PyYAML (6.0.x),
  llguidance==1.9.1 (inferd.engine imports the structured-output backend).
Triton (3.6.0 with torch 2.11) is used only by the triton section. inferd's C++ CPU kernels are
not needed on a CUDA device; the environment section reports whether any got built.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch

REFERENCE = Path(__file__).resolve().parent / "gpu_reference.json"
# The sections after `environment`, in the order they run.
SECTIONS = ("triton", "parity", "speculation", "memory_plan", "step_time", "syncs", "cuda_graphs")

# The parity model: small enough for a CPU reference in seconds, wide enough that greedy has no
# near-ties in fp32 (the test helpers scale the random weights so logits spread).
PARITY_SPEC = dict(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=512,
                   max_position=1024, seed=1234)  # fmt: skip
PARITY_PROMPTS = [
    [1, 17, 42, 99, 7, 300, 12, 55, 17, 42, 99, 7, 81, 201, 33],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8],
    [1, 250, 251, 252, 253, 250, 251, 252, 253, 250, 251],
    [1] + list(range(100, 140)),
]
PARITY_NEW_TOKENS = 32

# Llama-3-8B's shape; the CPU dry run keeps the vocabulary and shrinks the rest.
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
LLAMA_8B_MINI = dict(LLAMA_8B, vocab_size=32000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64)  # fmt: skip


# ---- the report -------------------------------------------------------------------------------
class Report:
    """Sections run in order under one time budget; the summary is rewritten after each."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.sections: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, message: str) -> None:
        print(f"[gpu_check +{self.elapsed():6.1f}s] {message}", flush=True)

    def run(self, name: str, fn: Callable[[], dict[str, Any]], needs_s: float = 0.0) -> dict[str, Any] | None:
        """Run one section; a failure is recorded (with its traceback's last lines) and the run
        goes on. Skipped when less than `needs_s` of the budget is left."""
        left = self.budget_s - self.elapsed()
        if left < needs_s:
            self._record(name, "skipped", 0.0, {}, f"budget: {left:.0f} s left, needs ~{needs_s:.0f} s")
            return None
        self.say(f"{name}: start")
        t0 = time.monotonic()
        try:
            result = fn()
        except SkipSection as e:
            self._record(name, "skipped", time.monotonic() - t0, {}, str(e))
            return None
        except Exception as e:  # a section's failure is a result, not the end of the run
            tail = "".join(traceback.format_exception(e)[-3:]).strip()
            self._record(name, "failed", time.monotonic() - t0, {}, f"{type(e).__name__}: {e}\n{tail}")
            return None
        ok = result.pop("ok", True)
        self._record(name, "ok" if ok else "mismatch", time.monotonic() - t0, result, "")
        return result

    def _record(self, name: str, status: str, seconds: float, result: dict[str, Any], note: str) -> None:
        self.sections.append({"name": name, "status": status, "seconds": round(seconds, 2),
                              "result": result, "note": note})  # fmt: skip
        self.say(f"{name}: {status} in {seconds:.1f} s" + (f" ({note.splitlines()[0]})" if note else ""))
        for key, value in result.items():
            self.say(f"  {key}: {json.dumps(value, default=str)[:300]}")
        self.write()

    def write(self) -> None:
        summary = {"elapsed_s": round(self.elapsed(), 1), "budget_s": self.budget_s, "sections": self.sections}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        lines = ["# inferd GPU check", "", f"elapsed {self.elapsed():.0f} s of a {self.budget_s:.0f} s budget", ""]
        for s in self.sections:
            lines.append(f"## {s['name']}: {s['status']} ({s['seconds']} s)")
            if s["note"]:
                lines += ["", "```", s["note"], "```"]
            lines.append("")
            for key, value in s["result"].items():
                lines.append(f"- **{key}**: `{json.dumps(value, default=str)}`")
            lines.append("")
        (self.out / "summary.md").write_text("\n".join(lines))


class SkipSection(Exception):
    """What a section needs is missing here: recorded as skipped, with the reason."""


# ---- helpers ----------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        import psutil

        return {"available_gib": round(psutil.virtual_memory().available / 2**30, 2)}
    free, total = torch.cuda.mem_get_info(device)
    return {"free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2)}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def parity_model(directory: Path):
    """The seeded tiny Llama GGUF (fp32) of the parity check, written by the test helpers, and
    a digest of its weights (a torch whose RNG drew other numbers would show here first)."""
    try:
        from tiny_models import TinySpec, make_state_dict, write_gguf
    except ImportError as e:
        raise SkipSection(f"tests/tiny_models.py cannot be imported ({e}); carry gguf==0.19.0 and PyYAML") from e
    spec = TinySpec(**PARITY_SPEC)
    model = write_gguf(directory / "parity.gguf", spec, quant="f32")
    sd = make_state_dict(spec, model.vocab_size)
    digest = hashlib.sha256()
    for name in sorted(sd):
        digest.update(name.encode())
        digest.update(sd[name].numpy().tobytes())
    return model.path, digest.hexdigest()[:16]


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from inferd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference_tokens(work: Path) -> dict[str, Any]:
    """The CPU reference the parity section compares against (`--write-reference`)."""
    from inferd import LLM

    path, digest = parity_model(work)
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="none", verbose=False, seed=0)
    tokens = greedy_tokens(llm, PARITY_PROMPTS, PARITY_NEW_TOKENS)
    return {"spec": PARITY_SPEC, "weights_sha256_16": digest, "prompts": PARITY_PROMPTS,
            "new_tokens": PARITY_NEW_TOKENS, "tokens": tokens, "torch": torch.__version__,
            "computed_on": f"{platform.machine()} CPU, fp32, --quantization none"}  # fmt: skip


def engine_args_known(*names: str) -> bool:
    from inferd.engine_args import ENGINE_ARGS

    return all(n in ENGINE_ARGS for n in names)


# ---- sections ---------------------------------------------------------------------------------
def environment(device: torch.device, quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "numpy", "safetensors", "tokenizers", "gguf", "llguidance"):
        try:
            result[mod] = getattr(__import__(mod), "__version__", "present")
        except ImportError:
            result[mod] = None
    result["cpus"] = os.cpu_count()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result["gpu"] = props.name
        result["capability"] = f"{props.major}.{props.minor}"
        result["cuda"] = torch.version.cuda
    result.update(free_memory(device))
    nbytes = (64 << 20) if quick or device.type != "cuda" else (2 << 30)
    result["copy_bandwidth_gbs"] = round(copy_bandwidth(device, nbytes) / 1e9, 1)
    return result


def triton_kernels(device: torch.device, quick: bool, bandwidth_gbs: float | None, deadline: float) -> dict[str, Any]:
    """Each kernel configuration's selfcheck (max error against its reference, time, GB/s), until
    `deadline` (time.monotonic()); a configuration that raises is recorded and the next runs."""
    try:
        from inferd.kernels.triton import selfcheck
    except ImportError as e:
        raise SkipSection(f"inferd.kernels.triton.selfcheck is not importable ({e})") from e
    if quick:
        attention = [(1, 64, 4, 2, 64, "auto")]
        gemms = [(1, 64, 64, "int8")]
    else:
        attention = [(b, ctx, 32, 8, 128, kv) for kv in ("bfloat16", "fp8") for b in (1, 32, 128)
                     for ctx in (1024, 8192) if b * ctx <= 32 * 8192]  # fmt: skip
        gemms = [(m, n, k, fmt) for fmt in ("int4", "int8", "fp8") for m in (1, 32)
                 for (n, k) in ((14336, 4096), (4096, 14336))]  # fmt: skip
    checks = [(f"paged_attention b{b} ctx{c} {h}/{kvh}x{d} kv={kv}", selfcheck.check_paged_attention, (device, b, c, h, kvh, d, kv))
              for b, c, h, kvh, d, kv in attention]  # fmt: skip
    checks += [(f"quant_gemm {m}x{n}x{k} {fmt}", selfcheck.check_quant_gemm, (device, m, n, k, fmt))
               for m, n, k, fmt in gemms]  # fmt: skip
    result: dict[str, Any] = {}
    for key, check, args in checks:
        if time.monotonic() > deadline:
            result[key] = "skipped: the section's time is spent"
            continue
        try:
            result[key] = _with_share(check(*args), bandwidth_gbs)
        except Exception as e:  # one configuration's failure is its result
            result[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    result["ok"] = not any(isinstance(v, dict) and "error" in v for v in result.values())
    return result


def _with_share(check: dict[str, Any], bandwidth_gbs: float | None) -> dict[str, Any]:
    """The selfcheck's dict plus its GB/s as a share of the measured copy bandwidth."""
    gbs = check.get("gbps") or check.get("gbs")
    if isinstance(gbs, (int, float)) and bandwidth_gbs:
        check = dict(check, share_of_copy_bandwidth=round(gbs / bandwidth_gbs, 3))
    return check


def parity(device: torch.device, work: Path) -> dict[str, Any]:
    from inferd import LLM

    if not REFERENCE.exists():
        raise SkipSection(f"{REFERENCE.name} is missing: run with --write-reference on a CPU")
    ref = json.loads(REFERENCE.read_text())
    path, digest = parity_model(work)
    if digest != ref["weights_sha256_16"]:
        raise SkipSection(f"the seeded weights differ from the reference's (torch {torch.__version__} "
                          f"vs {ref['torch']}): the comparison would mean nothing")  # fmt: skip
    llm = LLM(str(path), device=str(device), dtype="float32", quantization="none", verbose=False, seed=0)
    tokens = greedy_tokens(llm, ref["prompts"], ref["new_tokens"])
    first_diff = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None)
                  for t, r in zip(tokens, ref["tokens"])]  # fmt: skip
    del llm
    release(device)
    return {"ok": tokens == ref["tokens"], "sequences": len(tokens), "first_differing_token": first_diff}


def speculation(device: torch.device, quick: bool, work: Path) -> dict[str, Any]:
    from inferd import LLM

    path, _ = parity_model(work)
    common = dict(device=str(device), dtype="float32", quantization="none", verbose=False, seed=0)
    plain = greedy_tokens(LLM(str(path), **common), PARITY_PROMPTS, PARITY_NEW_TOKENS)
    release(device)
    spec = {"method": "ngram", "num_speculative_tokens": 2 if quick else 4, "prompt_lookup_max": 3,
            "disable_by_batch_size": 64, "adaptive_depth": False}  # fmt: skip
    # Fixed depth: this section checks that verification changes no token, not when drafting
    # pays (a measured policy may rightly find a tiny model's drafts too dear and draft none).
    llm = LLM(str(path), speculative_config=spec, max_num_seqs=len(PARITY_PROMPTS), **common)
    drafted = greedy_tokens(llm, PARITY_PROMPTS, PARITY_NEW_TOKENS)
    stats = llm.engine.stats
    accepted = stats.spec_accepted_tokens
    proposed = stats.spec_draft_tokens
    del llm
    release(device)
    return {"ok": drafted == plain, "draft_tokens": proposed, "accepted_tokens": accepted}


def build_8b_engine(device: torch.device, quick: bool, work: Path, **engine_args: Any):
    """An EngineCore serving a random Llama of 8B's shape (bf16 on a GPU), its weights drawn on
    the device: no file is written. The tokenizer is the parity model's (ids above its vocabulary
    decode to nothing; the checks drive token ids)."""
    from inferd.config import ModelConfig
    from inferd.engine.core import EngineCore
    from inferd.engine.llm import LLM
    from inferd.loader import LoadedModel, load_model

    shape = LLAMA_8B_MINI if quick or device.type != "cuda" else LLAMA_8B
    cfg = ModelConfig(architecture="llama", max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=1, eos_token_ids=(2,), name="random-llama-8b-shape", **shape)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=dtype) * size[-1] ** -0.5)

    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=dtype, device=device),
               "lm_head.weight": rand(v, h)}  # fmt: skip
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        weights |= {p + "input_layernorm.weight": torch.ones(h, dtype=dtype, device=device),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype, device=device),
                    p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                    p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                    p + "mlp.down_proj.weight": rand(h, i)}  # fmt: skip
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    path, _ = parity_model(work)
    tokenizer = load_model(str(path), verbose=False, quantization="none").tokenizer
    loaded = LoadedModel(cfg, weights, tokenizer, "in memory", f"random {dtype}".replace("torch.", ""))
    # No KV prefault thread (CPU pools): one still faulting pages in when the process exits
    # aborts it ("terminate called without an active exception").
    args = dict(device=str(device), dtype=str(dtype).removeprefix("torch."), quantization="none",
                max_num_seqs=64, max_model_len=2048, kv_cache_prefault=0, **engine_args)  # fmt: skip
    engine = EngineCore(LLM.engine_config(None, **args), loaded=loaded, verbose=False)
    del loaded, weights
    release(device)
    return engine, weight_bytes


def decode_step_times(engine, batch: int, steps: int, prompt_len: int = 32) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences (after their prefill)."""
    from inferd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"b{batch}-{r}" for r in range(batch)]
    for r, rid in enumerate(ids):
        engine.add_request(rid, [1 + (r * 7 + t) % 300 for t in range(prompt_len)], params)
    started: set[str] = set()
    for _ in range(64):  # prefill (chunked as the scheduler likes) until every sequence decodes
        started |= {d.request_id for d in engine.step() if d.new_token_ids}
        if len(started) == batch:
            break
    synchronize(engine.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort_request(rid)
    return times


def memory_plan(device: torch.device, quick: bool, work: Path) -> dict[str, Any]:
    before = free_memory(device)
    engine, weight_bytes = build_8b_engine(device, quick, work, gpu_memory_utilization=0.9)
    plan = getattr(engine, "memory_plan", None)
    result = {"free_before": before, "weight_gib": round(weight_bytes / 2**30, 2),
              "kv_blocks": engine.kv.pool.num_blocks, "max_model_len": engine.max_model_len,
              "plan": plan.as_dict() if hasattr(plan, "as_dict") else str(plan),
              "free_after_start": free_memory(device)}  # fmt: skip
    if device.type == "cuda":
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del engine
    release(device)
    return result


def step_time(device: torch.device, quick: bool, work: Path, bandwidth_gbs: float | None) -> dict[str, Any]:
    """The real engine's decode step at batch 1/8/32, with CUDA graphs (the default on a GPU)
    and with `enforce_eager=True`; on the CPU both run eagerly."""
    batches = (1, 4) if quick else (1, 8, 32)
    steps = 3 if quick else 20
    modes = {"default": {}}
    if engine_args_known("enforce_eager"):
        modes = {"cuda_graphs": {}, "eager": {"enforce_eager": True}}
    result: dict[str, Any] = {}
    for mode, extra in modes.items():
        engine, weight_bytes = build_8b_engine(device, quick, work, kv_cache_memory=4 << 30 if not quick else 64 << 20, **extra)
        graphs = getattr(engine.runner, "graphs", None)
        if mode != "eager":
            result["graphs"] = graphs.describe() if graphs is not None else "none captured"
        limit_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3 if bandwidth_gbs else None
        for b in batches:
            bucketed = getattr(engine.runner, "bucket_steps", 0)
            times = decode_step_times(engine, b, steps)
            ms = statistics.median(times) * 1e3
            entry = {"median_ms": round(ms, 3), "min_ms": round(min(times) * 1e3, 3),
                     "tokens_per_s": round(b / ms * 1e3, 1),
                     "bucketed_steps": getattr(engine.runner, "bucket_steps", 0) - bucketed}  # fmt: skip
            if limit_ms:
                entry["weight_bandwidth_limit_ms"] = round(limit_ms, 3)
                entry["share_of_limit"] = round(limit_ms / ms, 3)
            result[f"{mode} batch {b}"] = entry
        del engine
        release(device)
    if "eager" not in modes:
        result["cuda_graphs"] = "not compared: this tree has no --enforce-eager"
    else:
        for b in batches:
            g, e = result[f"cuda_graphs batch {b}"], result[f"eager batch {b}"]
            result[f"speedup batch {b}"] = round(e["median_ms"] / g["median_ms"], 2)
    return result


def graph_vs_eager(device: torch.device, quick: bool, work: Path) -> dict[str, Any]:
    """One decode step's forward (the model and its logits, no sampling) at a fixed batch and
    context, eager against a CUDA graph captured of the very same step and replayed: what
    capturing saves, measured apart from the engine's own graphs (the engine is built with
    `enforce_eager=True` where it knows the flag). Replayed logits must equal eager ones."""
    from inferd.kv.kv_cache_manager import KVCacheManager
    from inferd.sampling.params import SamplingParams
    from inferd.scheduler.scheduler import SchedulerOutput
    from inferd.scheduler.sequence import Sequence

    eager = {"enforce_eager": True} if engine_args_known("enforce_eager") else {}
    engine, _ = build_8b_engine(device, quick, work, kv_cache_memory=4 << 30 if not quick else 64 << 20, **eager)
    runner, model = engine.runner, engine.runner.model
    context, iters = (64, 3) if quick else (512, 20)
    result: dict[str, Any] = {}
    for b in (1, 4) if quick else (1, 8, 32):
        kv = KVCacheManager(runner.num_blocks, runner.block_size, False, runner.layout)
        seqs = []
        for r in range(b):
            seq = Sequence("graph", 0, [1 + (r * 7 + t) % 300 for t in range(context)], context,
                           SamplingParams(max_tokens=None))  # fmt: skip
            kv.allocate_slots(seq.seq_id, 0, context)
            seq.num_computed_tokens = context - 1  # its last token decodes; the pool's K/V are zeros
            seqs.append(seq)
        step = runner.prepare(SchedulerOutput.of([(s, 1) for s in seqs], kv))

        def forward(step=step) -> torch.Tensor:
            hidden = model(step.input_ids, step.positions, runner.kv_caches, step.meta)
            return model.compute_logits(hidden)

        entry: dict[str, Any] = {}
        with torch.inference_mode():
            for _ in range(2):
                eager_logits = forward()
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                forward()
            synchronize(device)
            entry["eager_ms"] = round((time.perf_counter() - t0) / iters * 1e3, 3)
            if device.type != "cuda":
                entry["graph"] = "CUDA only"
            else:
                try:
                    side = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        forward()  # warm-up on a side stream, as capture wants
                    torch.cuda.current_stream(device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        graph_logits = forward()
                    graph.replay()
                    synchronize(device)
                    entry["replay_max_abs_diff"] = float((graph_logits - eager_logits).abs().max())
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        graph.replay()
                    synchronize(device)
                    entry["graph_ms"] = round((time.perf_counter() - t0) / iters * 1e3, 3)
                    entry["speedup"] = round(entry["eager_ms"] / entry["graph_ms"], 2)
                    del graph
                except Exception as e:  # a host sync inside the forward makes capture fail
                    entry["graph"] = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
        for s in seqs:
            kv.free(s.seq_id)
        result[f"batch {b}, context {context}"] = entry
    del engine
    release(device)
    return result


def syncs_per_step(device: torch.device, quick: bool, work: Path) -> dict[str, Any]:
    """One decode step of 4 sequences as the engine runs it by default (a CUDA graph replay on a
    GPU): host syncs, readbacks, kernels and launch calls."""
    engine, _ = build_8b_engine(device, quick, work, kv_cache_memory=1 << 30 if not quick else 64 << 20)
    decode_step_times(engine, 4, 2)  # warm up: first-use allocations and captures
    graphs = getattr(engine.runner, "graphs", None)
    result: dict[str, Any] = {"graphs": graphs.describe() if graphs is not None else "none captured"}
    counter = getattr(engine.runner, "readbacks", None)
    if counter is not None:
        before = counter.count
        decode_step_times(engine, 4, 1)
        result["readbacks_per_step_incl_prefill"] = counter.count - before
    from inferd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for r in range(4):
        engine.add_request(f"s{r}", [1 + r, 2, 3, 4, 5, 6, 7, 8], params)
    for _ in range(3):  # prefill and one decode
        engine.step()
    if counter is not None:
        before = counter.count
        engine.step()
        result["readbacks_per_decode_step"] = counter.count - before
    if device.type == "cuda":
        import warnings

        synchronize(device)
        bucketed = getattr(engine.runner, "bucket_steps", 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result["step_in_a_bucket"] = getattr(engine.runner, "bucket_steps", 0) - bucketed == 1
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        result["host_syncs_per_decode_step"] = len(syncs)
        result["sync_kinds"] = sorted(set(syncs))[:5]
        # Where each one was called from (the Python line the warning points at).
        result["sync_sites"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                       if "synchroniz" in str(w.message)})[:12]  # fmt: skip
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                synchronize(device)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            result["kernels_per_decode_step"] = len(kernels)
            launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")]
            result["kernel_launch_calls_per_decode_step"] = len(launches)
        except Exception as e:  # the profiler's API moves between torch versions
            result["kernels_per_decode_step"] = f"profiler failed: {type(e).__name__}: {e}"
    for r in range(4):
        engine.abort_request(f"s{r}")
    del engine
    release(device)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip the sections left after this")
    p.add_argument("--quick", action="store_true", help="small shapes and few steps (the dry run)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="summary folder ($OUT)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated sections to run after environment (a device-side assert "
                        "poisons the CUDA context for the rest of a process: run groups apart)")  # fmt: skip
    p.add_argument("--write-reference", action="store_true",
                   help=f"compute the CPU reference tokens into {REFERENCE.name} and exit")  # fmt: skip
    args = p.parse_args(argv)
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    work = Path(tempfile.mkdtemp(prefix="inferd-gpu-check-"))
    # Models and conversions go to a scratch cache; compiled kernels stay where they were (a
    # compile takes minutes: `environment` says whether this run needed one).
    from inferd.loader.default_model import cache_dir

    os.environ.setdefault("INFERD_KERNEL_CACHE_DIR", str(cache_dir() / "kernels"))
    os.environ["INFERD_CACHE_DIR"] = str(work / "cache")
    if args.write_reference:
        torch.set_num_threads(1)
        ref = reference_tokens(work)
        REFERENCE.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in ref.items()) + "\n}\n")
        print(f"wrote {REFERENCE}")
        return 0
    device = torch.device(args.device)
    if device.type == "cpu":  # Triton kernels run on CPU tensors under its interpreter only
        os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            import triton_interpreter_compat  # tests/: the interpreter under numpy >= 2.4

            triton_interpreter_compat.apply()
        except ImportError:  # no triton: the triton section skips itself
            pass
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    report = Report(Path(args.out), args.budget_s)
    report.say(f"device {device}, budget {args.budget_s:.0f} s, output in {report.out}")
    env = report.run("environment", lambda: environment(device, args.quick)) or {}
    bandwidth = env.get("copy_bandwidth_gbs")
    # The Triton checks get at most 120 s (their compiles included): the engine's sections follow.
    triton_deadline = time.monotonic() + min(120.0, max(0.0, args.budget_s - report.elapsed() - 200.0))
    sections = {
        "triton": (lambda: triton_kernels(device, args.quick, bandwidth, triton_deadline), 20),
        "parity": (lambda: parity(device, work), 15),
        "speculation": (lambda: speculation(device, args.quick, work), 15),
        "memory_plan": (lambda: memory_plan(device, args.quick, work), 30),
        "step_time": (lambda: step_time(device, args.quick, work, bandwidth), 60),
        "syncs": (lambda: syncs_per_step(device, args.quick, work), 30),
        "cuda_graphs": (lambda: graph_vs_eager(device, args.quick, work), 30),
    }
    for name in SECTIONS:
        if name in chosen:
            run, needs_s = sections[name]
            report.run(name, run, needs_s=needs_s)
    from inferd.kernels.quant_gemm import extension

    report.say(f"inferd's CPU kernels were {'loaded' if extension.cache_info().currsize else 'not needed'} in this run")
    report.say(f"done in {report.elapsed():.0f} s; summary in {report.out}")
    statuses = [s["status"] for s in report.sections]
    print(json.dumps({"gpu_check": dict(zip([s["name"] for s in report.sections], statuses))}))
    return 1 if {"failed", "mismatch"} & set(statuses) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip the interpreter's teardown, where a native thread still alive
    # (a KV prefault, a kernel pool) can abort the process and turn a good run into a crash.
    os._exit(code)
