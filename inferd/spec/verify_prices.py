"""Verification prices (`inferd.spec.calibrate`) kept on disk, so that an engine
restarted with the same target, weights, KV cache, depth, batch bound, threads, machine and inferd
code starts without measuring again: measuring takes seconds on a fast CPU and up to a minute on a
slow one, where the start-up would otherwise pay it every time.

A file in `<inferd cache>/verify-prices/` per key (a SHA-256 of the key's JSON), holding the key,
the prices and when they were measured. Delete it to measure again. A file that cannot be read, or
whose key differs, is measured over. The prices decide only how deep to draft (verification is
lossless whatever they say), and the policy re-prices small batches from live steps
(`inferd.spec.step_times`) anyway.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from inferd.engine.model_runner import ModelRunner
from inferd.kernels.build import cpu_flags, cpu_model
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.loader.default_model import cache_dir
from inferd.quantization.policy import describe as describe_quantization
from inferd.spec.eagle_io import target_identity

logger = logging.getLogger("inferd.spec")

FORMAT = 1
Prices = tuple[dict[int, list[float]], dict[int, float]]  # (F by batch size, leaf cost by batch size)


@functools.cache
def _code_digest() -> str:
    """Every source file of the installed inferd (Python and the C++ kernels'): other code, other
    prices."""
    root = Path(__file__).resolve().parent.parent  # the inferd package
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".h", ".cpp")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _machine(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device)}
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()
    return {"device": "cpu", "cpu": cpu_model(), "flags": flags}


def price_key(runner: ModelRunner, kv: KVCacheManager, k: int, leaves: int, max_batch: int,
              context: int) -> dict[str, Any] | None:  # fmt: skip
    """What the prices depend on; None where the target cannot be identified (no cache then)."""
    try:
        identity = target_identity(runner.model)
    except (AttributeError, RuntimeError, TypeError):
        return None
    settings = {name: value for name, value in os.environ.items()
                if name.startswith("INFERD_") and not name.endswith("_DIR")}  # fmt: skip
    return {
        "format": FORMAT,
        "target": identity,
        "weights": describe_quantization(runner.model),
        "dtype": str(runner.dtype),
        "kv_cache_dtype": runner.kv_cache_dtype,
        "kv_layout": kv.layout.describe(),
        "block_size": kv.block_size,
        "tensor_parallel": runner.tp is not None,
        "k": k,
        "leaves": leaves,
        "max_batch": max_batch,
        "context": context,
        "threads": torch.get_num_threads(),
        **_machine(runner.device),
        "torch": torch.__version__,
        "inferd": _code_digest(),
        "settings": settings,
    }


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / "verify-prices" / f"{digest}.json"


def load(key: dict[str, Any]) -> Prices | None:
    """The prices measured under `key`, or None (none kept, or a file that does not read back)."""
    try:
        path = _path(key)
    except (OSError, ValueError) as e:  # no usable cache directory: measured every start
        logger.warning("speculation: no cache for the verification prices (%s)", e)
        return None
    try:
        saved = json.loads(path.read_text())
        if saved["key"] != json.loads(json.dumps(key)):
            return None
        cost = {int(b): [float(f) for f in fs] for b, fs in saved["cost"].items()}
        leaf_cost = {int(b): float(f) for b, f in saved["leaf_cost"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("speculation: ignoring %s (%s); measuring again", path, e)
        return None
    if not cost or any(len(fs) != key["k"] for fs in cost.values()):
        logger.warning("speculation: ignoring %s (prices of another depth); measuring again", path)
        return None
    logger.info("speculation: verification prices from %s, measured %s (delete it to measure "
                "again)", path, saved.get("measured", "?"))  # fmt: skip
    return cost, leaf_cost


def save(key: dict[str, Any], prices: Prices) -> None:
    """Keep `prices` for `key` (written whole or not at all; a failure to write is logged only)."""
    cost, leaf_cost = prices
    try:
        path = _path(key)
    except (OSError, ValueError):  # said once, by `load`
        return
    body = {"key": key, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cost": {str(b): fs for b, fs in cost.items()},
            "leaf_cost": {str(b): f for b, f in leaf_cost.items()}}  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("speculation: cannot keep the verification prices in %s (%s)", path, e)
