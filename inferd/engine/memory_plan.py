"""The KV pool's size, planned after the weights are loaded (`--gpu-memory-utilization` as vLLM).

    CUDA:  kv = total × utilization − (in use after load: weights, this process, others)
                − peak activations of one profiling forward at the largest step − a draft's weights
    CPU:   kv = min(available × utilization − activations (estimated) − a draft's weights,
                    max_auto_kv_cache_memory)   (the machine's memory is shared with everything)

A draft model's pool holds as many tokens as the target's (inferd/spec/draft_model.py), so the
pool's bytes are split between the two by their bytes per token. An explicit `--kv-cache-memory`
is the target's pool alone, as before: nothing is measured then.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil
import torch

from inferd.config import CacheConfig, ModelConfig

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes, as planned at start-up; `activation_source` says whether activations were measured
    ("profiled") or estimated from the shapes ("estimated"), or not counted ("explicit")."""

    device: str
    capacity: int  # CUDA: the device's total memory; CPU: memory available after load
    utilization: float
    in_use_after_load: int  # CUDA: everything allocated on the device before the pool (weights...)
    weight_bytes: int
    activation_bytes: int
    activation_source: str
    draft_weight_bytes: int
    kv_bytes: int  # the target's pool
    draft_kv_bytes: int
    num_blocks: int

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / _GIB:.2f} GiB"

        if self.activation_source == "explicit":
            return f"KV pool {gib(self.kv_bytes)} (--kv-cache-memory), weights {gib(self.weight_bytes)}"
        whole = "device memory" if self.device.startswith("cuda") else "available memory"
        draft = (f", draft weights {gib(self.draft_weight_bytes)} + draft KV {gib(self.draft_kv_bytes)}"
                 if self.draft_weight_bytes or self.draft_kv_bytes else "")  # fmt: skip
        used = f", in use after load {gib(self.in_use_after_load)}" if self.device.startswith("cuda") else ""
        return (f"{self.utilization:g} × {gib(self.capacity)} {whole}: weights {gib(self.weight_bytes)}"
                f"{used}, activations {gib(self.activation_bytes)} ({self.activation_source}){draft}"
                f" → KV pool {gib(self.kv_bytes)}, {self.num_blocks} blocks")  # fmt: skip

    def as_dict(self) -> dict[str, int | float | str]:
        return asdict(self)


def estimate_activation_bytes(cfg: ModelConfig, dtype: torch.dtype, num_tokens: int, num_seqs: int) -> int:
    """What a forward of `num_tokens` rows, `num_seqs` of them sampling, holds at its peak,
    counted from the shapes: a layer's live rows (residual, normed input, q/k/v, attention out,
    gate/up/act) plus fp32 logits twice (the sampler's softmax). Where nothing is measured."""
    elem = torch.empty((), dtype=dtype).element_size()
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.num_experts_per_tok, 1))
    per_row = (3 * cfg.hidden_size + 2 * q + kv + 3 * mlp) * elem
    return num_tokens * per_row + 2 * num_seqs * cfg.vocab_size * 4


def plan_kv_memory(
    cache: CacheConfig,
    device: torch.device,
    *,
    weight_bytes: int,
    activation_bytes: int,
    activation_source: str,
    bytes_per_block: int,
    draft_bytes_per_block: int = 0,
    draft_weight_bytes: int = 0,
    released_bytes: int = 0,
    to_load_bytes: int = 0,
) -> MemoryPlan:
    """The plan once the weights are resident. `bytes_per_block`: one target block;
    `draft_bytes_per_block`: what the draft's pool adds per target block (0: no draft model);
    `released_bytes`: device memory in use now that the pool will not keep (the profiling pool);
    `to_load_bytes`: weights not resident yet (`inferd info` plans before anything is built).
    ValueError where not even one block fits, naming what to change."""
    util = cache.gpu_memory_utilization
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
        return _checked(MemoryPlan(str(device), 0, util, 0, weight_bytes, 0, "explicit", 0,
                                   blocks * bytes_per_block, 0, blocks), cache.kv_cache_memory)  # fmt: skip
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free - released_bytes + to_load_bytes
        capacity = total
        budget = int(total * util) - in_use - activation_bytes - draft_weight_bytes
    else:
        in_use = 0
        capacity = psutil.virtual_memory().available
        budget = min(int(capacity * util) - activation_bytes - draft_weight_bytes - to_load_bytes,
                     cache.max_auto_kv_cache_memory)  # fmt: skip
    blocks = max(0, budget) // (bytes_per_block + draft_bytes_per_block)
    plan = MemoryPlan(str(device), capacity, util, in_use, weight_bytes, activation_bytes, activation_source,
                      draft_weight_bytes, blocks * bytes_per_block, blocks * draft_bytes_per_block, blocks)  # fmt: skip
    return _checked(plan, budget)


def _checked(plan: MemoryPlan, budget: int) -> MemoryPlan:
    if plan.num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {plan.describe()} (budget {budget} bytes, less than one "
            "block); raise --gpu-memory-utilization or --kv-cache-memory, or lower "
            "--max-num-batched-tokens / --max-num-seqs"
        )
    return plan


def profile_lengths(num_tokens: int, num_seqs: int, max_len: int) -> list[int]:
    """The profiling step's prompt lengths: `num_tokens` over `num_seqs` sequences (one long
    prefill and single-token prompts), the long one cut into pieces of at most `max_len` tokens,
    the positions the model has RoPE tables for (a position past them is an out-of-range index:
    a device-side assert on CUDA)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    long = num_tokens - num_seqs + 1
    pieces = [max_len] * (long // max_len) + ([long % max_len] if long % max_len else [])
    return pieces + [1] * (num_seqs - 1)


def profile_blocks(num_tokens: int, num_seqs: int, block_size: int, num_groups: int, max_len: int) -> int:
    """Blocks the profiling step's sequences take (`profile_activation_bytes`)."""
    lengths = profile_lengths(num_tokens, num_seqs, max_len)
    return num_groups * (sum(-(-n // block_size) for n in lengths) + 1)


def profile_activation_bytes(runner, num_tokens: int, num_seqs: int, vocab_size: int, max_len: int) -> int:
    """Peak CUDA memory one forward of the largest step (`run_profiling_step`) allocates beyond
    what is held before it, plus the sampler's fp32 softmax over its rows, which the forward does
    not allocate."""
    device = runner.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    rows = run_profiling_step(runner, num_tokens, num_seqs, max_len)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before + 2 * rows * vocab_size * 4


def run_profiling_step(runner, num_tokens: int, num_seqs: int, max_len: int) -> int:
    """One forward on the runner's (profiling) pool of the sequences `profile_lengths` gives,
    each sampling a row; returns the number of logits rows. The pool is left as it was found:
    every block free."""
    from inferd.kv.kv_cache_manager import KVCacheManager
    from inferd.sampling.params import SamplingParams
    from inferd.scheduler.scheduler import SchedulerOutput
    from inferd.scheduler.sequence import Sequence

    lengths = profile_lengths(num_tokens, num_seqs, max_len)
    kv = KVCacheManager(runner.num_blocks, runner.block_size, False, runner.layout)
    seqs = []
    for n in lengths:
        seq = Sequence("memory-profile", 0, [1] * n, n, SamplingParams(max_tokens=None))
        if not kv.allocate_slots(seq.seq_id, 0, n):
            raise RuntimeError("the profiling pool is too small for the profiling step")  # never expected
        seqs.append(seq)
    logits, _, _ = runner.execute(SchedulerOutput.of([(s, s.num_tokens) for s in seqs], kv))
    for s in seqs:
        kv.free(s.seq_id)
    return logits.shape[0]
