"""Medusa heads (Cai et al. 2024, Medusa-1: the target frozen): K small heads on the target's
final hidden state h_t at the last accepted position, head k (1..K) guessing the token at
t + 1 + k, all at once, with no chain between them:

    r_k = h_t + SiLU(W_k h_t + b_k)          (a residual block per head, W_k [H, H])
    logits_k = lm_head(r_k)                  (the target's own LM head, shared, not saved)

The target's own logits at t already give token t + 1; head 1 guesses t + 2, and so on. W_k starts
at zero, so an untrained head k reads the target's own guess for t + 1.

On disk a head directory holds `model.safetensors` (`weight` [K, H, H], `bias` [K, H], fp32),
`config.json` (sizes and the target's identity: `inferd.spec.eagle_io.target_identity`, checked
at load with `check_target`, so a head trained for another model is refused by name) and
optionally `draft_vocab.safetensors` (inferd.spec.draft_vocab: the tokens the heads score).
Training is inferd.train.train_medusa's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from inferd.spec import draft_vocab, eagle_kernels
from inferd.spec.eagle_io import CONFIG_FILE, WEIGHTS_FILE, check_target, target_identity

FORMAT = "inferd-medusa-head"
ARCHITECTURE = "residual-silu-v1"


class MedusaHead(nn.Module):
    """K residual heads over the target's final hidden state; see the module docstring."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int,
                 target: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"a Medusa head needs num_heads >= 1, got {num_heads}")
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, H, H]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))  # [K, H]
        self.target_info = target or {}
        # Set by `bind` / `prepare_inference`: kept out of the module's parameters (not saved).
        self.__dict__["_target"] = None
        self.__dict__["_vocab"] = None  # (token ids [V'], scoring linear [H] -> [V'])
        self.__dict__["_linear"] = None  # the K heads' W stacked [K * H, H], for inference

    @classmethod
    def for_target(cls, target: nn.Module, num_heads: int) -> MedusaHead:
        """A fresh (untrained) head bound to `target` (`LlamaForCausalLM`-like)."""
        cfg = target.config
        head = cls(cfg.hidden_size, cfg.vocab_size, num_heads, target=target_identity(target))
        ref = target.norm.weight
        return head.to(device=ref.device, dtype=torch.float32).bind(target)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "architecture": ARCHITECTURE,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "target": self.target_info,
        }

    def bind(self, target: nn.Module) -> MedusaHead:
        """Score with `target`'s LM head from now on; checks it is the one the head was trained
        for (ValueError naming both otherwise)."""
        if self.target_info:
            check_target(self.target_info, target)
        self.__dict__["_target"] = target
        return self

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("the Medusa head is not bound to a target model: call bind(target)")
        return self._target

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> each head's residual output [N, K, H] (training and reference)."""
        n, k, h = hidden.shape[0], self.num_heads, self.hidden_size
        lin = self._linear
        if lin is not None:  # the engine's stacked (maybe quantized) linear
            z = lin(hidden).view(n, k, h)
        else:
            z = torch.einsum("nh,kgh->nkg", hidden, self.weight)
        return hidden[:, None, :] + F.silu(z + self.bias)

    # ---- inference -----------------------------------------------------------------------
    def prepare_inference(self, ids: torch.Tensor | None, quantize: bool) -> MedusaHead:
        """Score only token `ids` (a draft vocabulary; None: all), the heads' W stacked into one
        linear; with `quantize` (fp32 CPU only) both int4 in the engine's packed tiles
        (`eagle_kernels.draft_linear`): a draft step reads these weights once per target step,
        and drafts only rank tokens (verification scores the target's own logits)."""
        target = self.target
        device = self.weight.device
        if ids is None:
            ids = torch.arange(self.vocab_size)
        lm_head = target.lm_head
        from inferd.layers.quantized_linear import QuantizedLinear

        if isinstance(lm_head, QuantizedLinear):
            from inferd.quantization.formats import dequantize_rows

            rows = dequantize_rows(lm_head.qweight, ids.cpu()).to(device)
        else:
            rows = lm_head.weight.detach()[ids.to(lm_head.weight.device)].to(device)
        rows = rows.to(self.weight.dtype)
        stacked = self.weight.detach().reshape(-1, self.hidden_size)
        fast = quantize and device.type == "cpu" and rows.dtype == torch.float32
        if fast:
            score, linear = eagle_kernels.draft_linear(rows), eagle_kernels.draft_linear(stacked)
        else:
            score, linear = _plain_linear(rows), _plain_linear(stacked)
        self.__dict__["_vocab"] = (ids.to(device), score)
        self.__dict__["_linear"] = linear
        return self

    @torch.inference_mode()
    def top(self, hidden: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's t likeliest tokens and their softmax probabilities over the scored tokens:
        hidden [N, H] -> (token ids [N, K, t], probabilities [N, K, t]), likeliest first."""
        if self._vocab is None:
            self.prepare_inference(None, quantize=False)
        ids, score = self._vocab
        r = self(hidden.to(self.weight.dtype))  # [N, K, H]
        logits = score(r.flatten(0, 1)).float()  # [N * K, V']
        probs, idx = logits.softmax(-1).topk(min(t, logits.shape[-1]), dim=-1)
        n, k = hidden.shape[0], self.num_heads
        return ids[idx].view(n, k, -1), probs.view(n, k, -1)

    # ---- on disk -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `path/model.safetensors` (fp32) and `path/config.json`; returns the directory."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
        (out / CONFIG_FILE).write_text(json.dumps(self.config, indent=1) + "\n")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], target: nn.Module, quantize: bool = False,
             num_heads: int | None = None) -> MedusaHead:  # fmt: skip
        """The head in `path`, bound to `target` and ready to draft (its draft vocabulary when
        the directory has one), on the target's device; `num_heads`: keep only the first ones.
        ValueError when `path` holds no Medusa head, a damaged one, or one trained for
        another model."""
        root = Path(path).expanduser()
        cfg_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
        if not cfg_path.is_file() or not weights_path.is_file():
            raise ValueError(f"{root}: not a Medusa head directory (needs {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")  # fmt: skip
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{cfg_path}: unreadable Medusa head config ({e})") from e
        if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
            raise ValueError(f"{cfg_path}: not an inferd Medusa head config (an EAGLE head is "
                             f'served with "method": "eagle")')  # fmt: skip
        if cfg.get("architecture") != ARCHITECTURE:
            raise ValueError(f"{cfg_path}: Medusa head architecture {cfg.get('architecture')!r} "
                             f"is not supported (this inferd reads {ARCHITECTURE!r})")  # fmt: skip
        try:
            head = cls(cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg.get("target"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{cfg_path}: incomplete Medusa head config ({e})") from e
        check_target(head.target_info, target, str(root))
        try:
            head.load_state_dict(load_file(str(weights_path)), strict=True)
        except Exception as e:  # safetensors' own error types, or shapes that do not fit
            raise ValueError(f"{weights_path}: unreadable Medusa head weights ({e})") from e
        if num_heads is not None and num_heads < head.num_heads:
            head = head.first(num_heads)
        ref = target.norm.weight
        head = head.to(device=ref.device).eval().requires_grad_(False).bind(target)
        return head.prepare_inference(draft_vocab.load(root, head.vocab_size), quantize)

    def first(self, n: int) -> MedusaHead:
        """A head of the first n heads only (drafting fewer tokens than were trained)."""
        out = type(self)(self.hidden_size, self.vocab_size, n, self.target_info)
        out.load_state_dict({"weight": self.weight[:n], "bias": self.bias[:n]})
        return out


def _plain_linear(weight: torch.Tensor) -> nn.Module:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                    dtype=weight.dtype).requires_grad_(False)  # fmt: skip
    lin.weight.copy_(weight)
    return lin
