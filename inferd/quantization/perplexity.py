"""Perplexity of a model under each `--quantization` mode on a fixed English text: the prose of
CPython's language reference (`pydoc_data/topics.py`, shipped with every CPython: nothing to fetch).

    python -m inferd.quantization.perplexity [--model M] [--tokens 20480] [--window 512]

The text is cut into non-overlapping windows; each window is one prefill through the model and
scores its next-token predictions. Modes int8/int4/fp8 quantize the fp32 weights (so "int4" tests
inferd's quantizer); "auto" keeps a GGUF's blocks as shipped; "kv-float16", "kv-bfloat16",
"kv-int8", "kv-fp8", "kv-fp8_e5m2" keep fp32 weights and store K/V as `--kv-cache-dtype` would
(attention reads every key and value back as stored, the window's own included). A "-a8" suffix ("auto-a8", "int4-a8") runs every
int8/int4 matmul on int8 activations, the numerics decode uses (windows alone would take the
fp32-activation prefill path). The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn.functional as F

from inferd.engine.model_runner import allocate_kv_cache
from inferd.kv.kv_cache import KVCache, kv_bytes_per_token
from inferd.layers.attention import AttentionMetadata, PrefillSlice
from inferd.loader import LoadedModel, load_model
from inferd.models import build_model
from inferd.quantization import formats
from inferd.quantization.formats import QuantizedWeight, dequantize
from inferd.quantization.policy import resident_weight_bytes


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def reference_tokens(loaded: LoadedModel, n: int) -> list[int]:
    ids = loaded.tokenizer.encode(reference_text())
    if len(ids) < n:
        raise ValueError(f"the reference text has only {len(ids)} tokens (< {n})")
    return ids[:n]


def build_for_mode(loaded: LoadedModel, mode: str, group: int = 32,
                   max_positions: int = 2048) -> torch.nn.Module:  # fmt: skip
    """The model under `mode`; int8/int4/fp8 start from the fp32 (dequantized) weights."""
    weights = loaded.weights
    if mode in ("int8", "int4", "fp8"):
        weights = {k: dequantize(v) if isinstance(v, QuantizedWeight) else v
                   for k, v in weights.items()}  # fmt: skip
    return build_model(loaded.config, weights, max_positions=max_positions, dtype=torch.float32,
                       device=torch.device("cpu"), quantization=mode,
                       quantization_group_size=group)  # fmt: skip


def _one_prefill(t: int, block: int, nblocks: int) -> AttentionMetadata:
    """Metadata of one sequence's whole-window prefill (slots 0..t-1); every other kind of batch
    row (whatever fields the attention backend has for decodes) left empty."""
    fields = dataclasses.fields(AttentionMetadata)
    kw = {f.name: None for f in fields if f.default is dataclasses.MISSING}
    kw.update(slot_mapping=torch.arange(t), block_size=block,
              prefills=[PrefillSlice(0, t, t, torch.arange(nblocks), None)])  # fmt: skip
    return AttentionMetadata(**kw)


@torch.inference_mode()
def perplexity(
    model: torch.nn.Module, ids: list[int], window: int = 512, kv_cache_dtype: str = "auto"
) -> float:
    """exp(mean NLL) of ids[1:] given the preceding tokens of their window."""
    cfg = model.config
    block = 16
    nblocks = (window + block - 1) // block
    storage = KVCache.storage_dtype(kv_cache_dtype, torch.float32)
    kv = KVCache(
        allocate_kv_cache(cfg, nblocks, block, storage, torch.device("cpu")), kv_cache_dtype
    )
    caches = kv.layers()
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start : start + window + 1])
        t = chunk.numel() - 1
        if t < 2:
            break
        pos = torch.arange(t)
        meta = _one_prefill(t, block, nblocks)
        logits = model.compute_logits(model(chunk[:-1], pos, caches, meta))
        nll += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += t
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=512)
    p.add_argument(
        "--modes",
        default="none,auto,auto-a8,int8,int8-a8,fp8,int4,int4-a8,int4-g64,int4-g128,kv-int8,kv-fp8,kv-fp8_e5m2",
    )
    args = p.parse_args(argv)
    loaded = load_model(args.model, quantization="auto")
    ids = reference_tokens(loaded, args.tokens)
    rows = []
    base = None
    for spec in args.modes.split(","):
        kv_dtype = spec.removeprefix("kv-") if spec.startswith("kv-") else "auto"
        # "-a8": int8 activations in every int8/int4 matmul (the engine's default); without, fp32
        # ones: the weights' own error.
        a8 = spec.endswith("-a8")
        weights = "none" if spec.startswith("kv-") else spec.removesuffix("-a8")
        mode, _, g = weights.partition("-g")
        t0 = time.perf_counter()
        model = build_for_mode(loaded, mode, int(g or 32), args.window + 1)
        with formats.int8_activations(a8):
            ppl = perplexity(model, ids, args.window, kv_dtype)
        base = ppl if spec == "none" else base
        row = {"mode": spec, "ppl": round(ppl, 4),
               "vs_fp32": round(ppl / base - 1, 5) if base else None,
               "weight_mib": round(resident_weight_bytes(model) / 2**20, 1), "kv_cache_dtype": kv_dtype,
               "kv_bytes_per_token": kv_bytes_per_token(loaded.config, torch.float32, kv_dtype),
               "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        rows.append(row)
        print(f"{spec:<10} ppl {ppl:9.4f}  vs fp32 {row['vs_fp32']}  weights "
              f"{row['weight_mib']} MiB  ({row['seconds']} s)", flush=True)  # fmt: skip
    print(json.dumps({"model": loaded.source, "tokens": len(ids), "window": args.window,
                      "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
