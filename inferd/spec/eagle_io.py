"""The learned draft head on disk, and the target model it belongs to.

A head directory holds `model.safetensors` (the head's weights, fp32) and `config.json` (sizes,
architecture and the target's identity, so that a head is never silently run against a model it
was not trained for), and optionally `draft_vocab.safetensors` (inferd.spec.draft_vocab). The
target's embedding and LM head are borrowed at load time, never saved with the head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from inferd.spec import draft_vocab

if TYPE_CHECKING:
    from inferd.spec.eagle_head import EagleHead

FORMAT = "inferd-eagle-head"
ARCHITECTURE = "fc-attn-v1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Rows of the target's embedding kept (first FINGERPRINT_DIMS values each) to recognise it later:
# the same model under another quantization matches within tolerance, another model does not.
FINGERPRINT_DIMS = 16
FINGERPRINT_MIN_COSINE = 0.98


def _fingerprint_ids(vocab_size: int) -> torch.Tensor:
    return torch.linspace(0, vocab_size - 1, 8).long()


def target_identity(target: nn.Module) -> dict[str, Any]:
    """Sizes, name and an embedding fingerprint of a target model (`LlamaForCausalLM`-like)."""
    cfg = target.config
    ids = _fingerprint_ids(cfg.vocab_size).to(target.norm.weight.device)
    with torch.no_grad():
        rows = target.embed_tokens(ids).float()[:, :FINGERPRINT_DIMS].cpu()
    return {
        "name": cfg.name,
        "architecture": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "fingerprint": [round(v, 6) for v in rows.flatten().tolist()],
    }


def check_target(saved: dict[str, Any], target: nn.Module, where: str = "") -> None:
    """ValueError unless `target` is the model `saved` (a `target_identity`) describes."""
    have = target_identity(target)
    who = f"{where}: " if where else ""
    for key in ("hidden_size", "vocab_size", "num_layers", "architecture"):
        if key in saved and saved[key] != have[key]:
            raise ValueError(
                f"{who}draft head was trained for {saved.get('name')!r} ({key} "
                f"{saved[key]}), the target model has {key} {have[key]}"
            )
    if saved.get("fingerprint"):
        a, b = torch.tensor(saved["fingerprint"]), torch.tensor(have["fingerprint"])
        cos = F.cosine_similarity(a, b, dim=0).item() if a.shape == b.shape else -1.0
        if not cos >= FINGERPRINT_MIN_COSINE:
            raise ValueError(
                f"{who}draft head was trained for {saved.get('name')!r}, not this "
                f"target model {have['name']!r} (embedding fingerprint differs: "
                f"cosine {cos:.3f})"
            )


def check_feature_layers(layers: tuple[int, ...], num_layers: int) -> None:
    """ValueError unless `layers` (a head's feature layers) are distinct, ascending layers of a
    target with `num_layers` layers."""
    if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
        raise ValueError(f"feature layers must be distinct, ascending and >= 0: {list(layers)}")
    if layers and layers[-1] >= num_layers:
        raise ValueError(
            f"draft head reads target layers {list(layers)}; the target model has {num_layers}"
        )


def save_head(head: EagleHead, path: str | os.PathLike[str]) -> Path:
    """Write `path/model.safetensors` (fp32) and `path/config.json`; returns the directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    (out / CONFIG_FILE).write_text(json.dumps(head.config, indent=1) + "\n")
    return out


def load_head(
    cls: type[EagleHead],
    path: str | os.PathLike[str],
    target_model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: bool = False,
) -> EagleHead:
    """A ready head of class `cls` bound to `target_model`, on `device` in `dtype` (default: the
    target's); with `quantize`, its linears int4 (`for_inference`; fp32 CPU only). ValueError
    when `path` holds no head, a damaged one, or one trained for another model."""
    root = Path(path).expanduser()
    cfg_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"{root}: not a draft head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: unreadable draft head config ({e})") from e
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_path}: not an inferd draft head config")
    if cfg.get("architecture") != ARCHITECTURE:
        raise ValueError(
            f"{cfg_path}: draft head architecture {cfg.get('architecture')!r} "
            f"is not supported (this inferd reads {ARCHITECTURE!r})"
        )
    try:
        sizes = [
            cfg[k]
            for k in (
                "hidden_size",
                "vocab_size",
                "num_heads",
                "num_kv_heads",
                "intermediate_size",
                "rms_norm_eps",
                "rope_theta",
            )
        ]
        head = cls(*sizes, target=cfg.get("target"), feature_layers=cfg.get("feature_layers", ()))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: incomplete draft head config ({e})") from e
    check_target(head.target_info, target_model, str(root))
    try:
        state = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{weights_path}: unreadable draft head weights ({e})") from e
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights_path}: weights do not match {cfg_path} ({e})") from e
    ref = target_model.norm.weight  # the target's compute device and dtype
    head = (
        head.to(device=device or ref.device, dtype=dtype or ref.dtype).eval().requires_grad_(False)
    )
    head.bind(target_model)
    if head.fc.weight.dtype == torch.float32 and head.fc.weight.is_cpu:
        head.for_inference(quantize)
    head.set_draft_vocab(draft_vocab.load(root, head.vocab_size))
    return head.gather_weights() if ref.is_cpu else head
