"""`inferd bench offline --scenario lora`: N concurrent requests spread over K LoRA adapters
against the same requests on the base model without LoRA, in one run, engines interleaved.

The adapters are random (every target module, rank `--lora-rank`), written in PEFT's format to a
temporary directory: what is measured is the cost of the batched delta, not what they learnt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inferd.bench.peers import inferd_generate_timed
from inferd.bench.prompts import synthetic_prompt
from inferd.lora.adapter import site_shapes

_TARGETS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
            "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}  # fmt: skip


def write_random_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every q/k/v/o/gate/up/down projection of a model of `cfg`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for site, (width, outs) in site_shapes(cfg).items():
        owner, modules = _TARGETS[site]
        for module, (_, out) in zip(modules, outs):
            for layer in range(cfg.num_layers):
                key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, width, generator=gen) / width**0.5
                )
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [m for _, ms in _TARGETS.values() for m in ms]}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def lora(ctx, a: argparse.Namespace) -> dict:
    from inferd.lora.request import LoRARequest

    n, n_in, n_out, k = a.num_prompts, a.input_len, a.output_len, a.lora_adapters
    prompts = [synthetic_prompt(ctx.tokenizer, n_in, seed=i) for i in range(n)]
    tmp = tempfile.TemporaryDirectory(prefix="inferd-bench-lora-")
    paths = [
        write_random_adapter(Path(tmp.name) / f"a{j}", ctx.loaded.config, a.lora_rank, j)
        for j in range(k)
    ]
    loras = [LoRARequest(f"a{i % k}", i % k + 1, str(paths[i % k])) for i in range(n)]
    sizes = {"max_num_seqs": max(n, 1), "max_num_batched_tokens": a.max_num_batched_tokens}
    base = ctx.engine(**sizes)
    adapted = ctx.engine(**sizes, enable_lora=True, max_loras=k, max_lora_rank=a.lora_rank)
    inferd_generate_timed(base, prompts[:2], 4)  # warm-up
    inferd_generate_timed(adapted, prompts[:k], 4, loras=loras[:k])
    # tok/s of wall time, and of the process's own CPU time (all threads): on a machine shared
    # with other jobs the wall clock measures them too.
    runs: dict[str, list[float]] = {"base": [], "lora": [], "base_cpu": [], "lora_cpu": []}
    for i in range(a.runs):  # interleaved: load from other jobs hits both alike
        for name, engine, reqs in (("base", base, None), ("lora", adapted, loras)):
            engine.reset_prefix_cache()
            cpu = time.process_time()
            wall = inferd_generate_timed(engine, prompts, n_out, loras=reqs).total_s
            runs[f"{name}_cpu"].append(n * n_out / (time.process_time() - cpu))
            runs[name].append(n * n_out / wall)
        print(f"run {i + 1}: base {runs['base'][-1]:.1f} tok/s ({runs['base_cpu'][-1]:.1f} per CPU s), "
              f"{k} adapters {runs['lora'][-1]:.1f} tok/s ({runs['lora_cpu'][-1]:.1f} per CPU s)")  # fmt: skip
    tmp.cleanup()
    med = {name: statistics.median(vs) for name, vs in runs.items()}
    ratio, ratio_cpu = round(med["lora"] / med["base"], 3), round(med["lora_cpu"] / med["base_cpu"], 3)
    print(f"\n{n} requests over {k} adapters (rank {a.lora_rank}): {med['lora']:.1f} tok/s; without "
          f"LoRA {med['base']:.1f} tok/s; ratio {ratio} (of CPU time: {ratio_cpu})")  # fmt: skip
    return {"lora_adapters": k, "lora_rank": a.lora_rank, "base_tps": round(med["base"], 3),
            "lora_tps": round(med["lora"], 3), "ratio_lora": ratio, "ratio_lora_cpu_time": ratio_cpu,
            "runs": {name: [round(v, 3) for v in vs] for name, vs in runs.items()}}  # fmt: skip
