"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read and
checked against the model it is to run on, as the per-site parts the batched delta takes.

A *site* is one of the decoder's linears as inferd stores it: `qkv` (q, k and v fused into one
projection), `o`, `gate_up` (gate and up fused) and `down`. A site's delta is the concatenation of
its parts' deltas along the output, a part without an adapter contributing zero:

    delta(x)[:, off_p : off_p + out_p] = scale_p * (x @ A_p^T) @ B_p^T    A_p [r_p, in], B_p [out_p, r_p]

The scale (`lora_alpha / r`, or `/ sqrt(r)` with rslora; PEFT's rank and alpha patterns per
module) is folded into B here, once. The base weights are never touched.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferd.config import ModelConfig

SITES = ("qkv", "o", "gate_up", "down")
# PEFT target module → (site, part index within the site). qkv_proj / gate_up_proj: checkpoints
# that store the fused projection themselves (Phi-3): one part spanning the whole output.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", 0),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "gate_up_proj": ("gate_up", 0),
    "down_proj": ("down", 0),
}  # fmt: skip
# Parts per site: how many rank blocks a slot holds there (inferd/lora/slots.py).
SITE_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)
_generations = itertools.count(1)


class LoRAError(ValueError):
    """An adapter that cannot serve on this model (the message names the problem)."""


@dataclass(slots=True)
class LoRAPart:
    a: torch.Tensor  # [r, in] fp32
    b: torch.Tensor  # [out_p, r] fp32, scale folded in
    offset: int  # first output column of the site this part writes


@dataclass(eq=False, slots=True)
class LoRAAdapter:
    """One load of an adapter: its parts per (layer, site) and its load generation (unique per
    read from disk, so KV cached under one load is never reused by another)."""

    name: str
    path: str
    rank: int  # the largest rank of its parts
    parts: dict[tuple[int, str], list[tuple[int, LoRAPart]]]  # (layer, site) → [(part index, part)]
    generation: int = field(default_factory=lambda: next(_generations))
    slot: int = -1  # the slot it occupies (LoRASlots), -1: none

    @property
    def cache_salt(self) -> str:
        """What its requests' prefix-cache blocks are keyed under (with the request's own salt)."""
        return f"lora:{self.name}#{self.generation}"

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for ps in self.parts.values() for _, p in ps)


def site_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Per site: its input width and, per part, (output offset, output width)."""
    q, kv, h, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    return {
        "qkv": (h, [(0, q), (q, kv), (q + kv, kv)]),
        "o": (q, [(0, h)]),
        "gate_up": (h, [(0, inter), (inter, inter)]),
        "down": (inter, [(0, h)]),
    }


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name's end."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_config(path: Path) -> dict:
    """The adapter's adapter_config.json, checked for what inferd serves."""
    if not path.is_dir():
        raise LoRAError(f"{path} is not a LoRA adapter: not a directory")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"{path} is not a LoRA adapter: no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(
            f"{path}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} is not LORA"
        )
    if cfg.get("use_dora"):
        raise LoRAError(f"{path}: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(
            f"{path}: adapters that train biases (bias={cfg['bias']!r}) are not supported"
        )
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"{path}: modules_to_save {cfg['modules_to_save']} (fully trained modules) are not supported"
        )
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"{path}: fan_in_fan_out adapters are not supported")
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    st, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if bin_file.is_file():
            return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise LoRAError(f"{path}: cannot read the adapter's weights ({e})") from None
    raise LoRAError(f"{path} is not a LoRA adapter: no adapter_model.safetensors")


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read the adapter at `path` for a model of `cfg`; LoRAError naming what does not fit (rank
    over `max_rank`, a target module inferd does not adapt, shapes of another base model)."""
    path = Path(path)
    conf = read_config(path)
    base = conf.get("base_model_name_or_path") or "an unnamed base model"
    weights = _read_weights(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoRAError(f"{path}: unknown target module in weight {key!r} (inferd adapts "
                            f"{', '.join(sorted(TARGETS))} of the decoder layers)")  # fmt: skip
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise LoRAError(f"{path}: unknown target module {module!r} (inferd adapts "
                            f"{', '.join(sorted(TARGETS))})")  # fmt: skip
        if layer >= cfg.num_layers:
            raise LoRAError(f"{path}: adapter for base model {base!r} has layer {layer}; this "
                            f"model has {cfg.num_layers} layers")  # fmt: skip
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise LoRAError(f"{path}: the adapter has no LoRA weights")
    shapes = site_shapes(cfg)
    parts: dict[tuple[int, str], list[tuple[int, LoRAPart]]] = {}
    top_rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"{path}: layer {layer} {module} has lora_{''.join(ab)} without its pair"
            )
        a, b = ab["A"].float(), ab["B"].float()
        site, index = TARGETS[module]
        width, outs = shapes[site]
        offset, out = (
            (0, sum(o for _, o in outs)) if module in ("qkv_proj", "gate_up_proj") else outs[index]
        )
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise LoRAError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)} are not a rank-r pair")  # fmt: skip
        if a.shape[1] != width or b.shape[0] != out:
            raise LoRAError(f"{path}: base model mismatch: adapter for {base!r} has layer {layer} "
                            f"{module} of {a.shape[1]} -> {b.shape[0]}; this model's is {width} -> {out}")  # fmt: skip
        if r > max_rank:
            raise LoRAError(
                f"{path}: rank {r} (layer {layer} {module}) exceeds --max-lora-rank {max_rank}"
            )
        full = f"model.layers.{layer}.{module}"
        rank_cfg = _pattern_value(conf.get("rank_pattern"), full, conf.get("r", r))
        alpha = _pattern_value(conf.get("alpha_pattern"), full, conf.get("lora_alpha", rank_cfg))
        scale = alpha / math.sqrt(rank_cfg) if conf.get("use_rslora") else alpha / rank_cfg
        parts.setdefault((layer, site), []).append(
            (index, LoRAPart(a.contiguous(), (b * scale).contiguous(), offset))
        )
        top_rank = max(top_rank, r)
    return LoRAAdapter(name, str(path), top_rank, parts)
