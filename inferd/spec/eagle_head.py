"""EAGLE-style learned draft head: from the target's hidden state at position t and the token at
t + 1, predict the target's hidden state at t + 1, in the target's own space, so that the target's
LM head turns it into logits for the token at t + 2. Chaining k steps (feed the predicted feature
back with the drafted token) drafts k tokens for the target to verify in one forward.

The head borrows the target's embedding (`target.embed_tokens`) and LM head
(`target.compute_logits`); neither is saved with it. It has no KV cache and no attention over
history: the target's hidden state already summarises the context, and a stateless head keeps the
engine's side to "call it k times on [B, H] rows".

    feature = out_norm(x + Σ swiglu_block(x)),  x = fc([norm_h(hidden), norm_e(embed(token))])

`out_norm` starts as a copy of the target's final norm: the target's hidden states (which
`LlamaForCausalLM.forward` returns after that norm) live on its scale, and so do the predictions.

On disk (`save` / `load`): a directory with `model.safetensors` (the head's weights) and
`config.json` (sizes, architecture, and the target's identity, so a head is never silently run
against a model it was not trained for), and optionally `draft_vocab.safetensors`: the frequent
tokens greedy drafting scores (inferd.spec.draft_vocab).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from inferd.spec import draft_vocab

FORMAT = "inferd-eagle-head"
ARCHITECTURE = "fc-swiglu-v1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Rows of the target's embedding kept (first FINGERPRINT_DIMS values each) to recognise it later:
# the same model under another quantization matches within tolerance, another model does not.
FINGERPRINT_DIMS = 16
FINGERPRINT_MIN_COSINE = 0.98


class SwiGLUBlock(nn.Module):
    """Pre-norm residual MLP, the shape of a Llama MLP: x + down(silu(gate(n(x))) * up(n(x)))."""

    def __init__(self, hidden: int, inter: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).split(self.inter, dim=-1)
        return x + self.down(F.silu(gate) * up)


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
            raise ValueError(f"{who}draft head was trained for {saved.get('name')!r} ({key} "
                             f"{saved[key]}), the target model has {key} {have[key]}")  # fmt: skip
    if saved.get("fingerprint"):
        a, b = torch.tensor(saved["fingerprint"]), torch.tensor(have["fingerprint"])
        cos = F.cosine_similarity(a, b, dim=0).item() if a.shape == b.shape else -1.0
        if not cos >= FINGERPRINT_MIN_COSINE:
            raise ValueError(f"{who}draft head was trained for {saved.get('name')!r}, not this "
                             f"target model {have['name']!r} (embedding fingerprint differs: "
                             f"cosine {cos:.3f})")  # fmt: skip


class EagleHead(nn.Module):
    """The draft head. `bind(target)` (done by `load`) lends it the target's embedding and LM head
    (training binds the fp32 copy of the target, which autograd can run through)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_blocks: int = 1,
        intermediate_size: int | None = None,
        rms_norm_eps: float = 1e-5,
        target: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or vocab_size <= 0 or num_blocks < 0:
            raise ValueError(f"bad draft head sizes: hidden {hidden_size}, vocab {vocab_size}, "
                             f"blocks {num_blocks}")  # fmt: skip
        inter = intermediate_size or 2 * hidden_size
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_blocks, self.intermediate_size, self.rms_norm_eps = num_blocks, inter, rms_norm_eps
        self.target_info = dict(target or {})
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.embed_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.blocks = nn.ModuleList(SwiGLUBlock(hidden_size, inter, rms_norm_eps)
                                    for _ in range(num_blocks))  # fmt: skip
        self.out_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        # Small residual branches at init: each block starts near the identity.
        for b in self.blocks:
            nn.init.normal_(b.down.weight, std=0.02 / math.sqrt(2 * max(num_blocks, 1)))
        # The bound target, outside the module tree: never saved, moved or trained with the head.
        self.__dict__["_target"] = None
        # (token ids [N], LM head over those rows) when drafting over a reduced vocabulary.
        self.__dict__["_draft_vocab"] = None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target: nn.Module, **kwargs: Any) -> EagleHead:
        """A fresh head sized for `target`, its output norm copied from the target's final norm."""
        cfg = target.config
        kwargs.setdefault("rms_norm_eps", cfg.rms_norm_eps)
        head = cls(cfg.hidden_size, cfg.vocab_size, target=target_identity(target), **kwargs)
        with torch.no_grad():
            head.out_norm.weight.copy_(target.norm.weight.float())
        return head.bind(target)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "architecture": ARCHITECTURE,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_blocks": self.num_blocks,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "target": self.target_info,
        }

    def bind(self, target: nn.Module) -> EagleHead:
        """Use `target`'s embedding and LM head from now on (no copy); checks it is the one the
        head was trained for."""
        if self.target_info:
            check_target(self.target_info, target)
        self.__dict__["_target"] = target
        return self

    def set_draft_vocab(self, ids: torch.Tensor | None) -> EagleHead:
        """Draft over these token ids only (inferd.spec.draft_vocab; None: the whole vocabulary):
        greedy drafting scores just their rows of the target's LM head. The rows are copied once
        (quantized heads stay quantized); training and `return_logits` still see every token."""
        if ids is None:
            self.__dict__["_draft_vocab"] = None
            return self
        from inferd.layers.quantized_linear import QuantizedLinear

        lm_head = self.target.lm_head
        if isinstance(lm_head, QuantizedLinear):
            rows: nn.Module = QuantizedLinear(lm_head.qweight.rows(ids.cpu()).to(ids.device))
        else:
            rows = nn.Linear(lm_head.weight.shape[1], len(ids), bias=False, device=lm_head.weight.device,
                             dtype=lm_head.weight.dtype).requires_grad_(False)  # fmt: skip
            rows.weight.copy_(lm_head.weight.detach()[ids.to(lm_head.weight.device)])
        self.__dict__["_draft_vocab"] = (ids.to(self.target.norm.weight.device), rows)
        return self

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self._draft_vocab is None else len(self._draft_vocab[0])

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("the draft head is not bound to a target model: call bind(target)")
        return self._target

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- compute -----------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,  # [B, H] target hidden state at t (after its final norm)
        token_ids: torch.Tensor,  # [B] token at t + 1
        embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Predicted target hidden state at t + 1: [B, H] in the head's dtype."""
        embed = embed_fn or self.target.embed_tokens
        dtype = self.fc.weight.dtype
        e = embed(token_ids).to(dtype)
        x = torch.cat([self.hidden_norm(hidden.to(dtype)), self.embed_norm(e)], dim=-1)
        x = self.fc(x)
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] of the target's LM head applied to predicted features."""
        target = self.target
        return target.compute_logits(feature.to(target.norm.weight.dtype))

    @torch.no_grad()
    def draft(
        self,
        hidden: torch.Tensor,  # [B, H]
        token_ids: torch.Tensor,  # [B]
        k: int,
        return_logits: bool = False,
        choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chain of k drafted tokens [B, k] (for tokens t + 2 .. t + k + 1) and, when asked, the
        logits each was drafted from [B, k, V] fp32 (what rejection sampling needs as q).

        `choose(logits [B, V], step) -> tokens [B]` picks each drafted token (at temperature > 0:
        sample from the processed distribution); default greedy (argmax)."""
        tokens, logits = [], []
        feature, tok = hidden, token_ids
        reduced = self._draft_vocab if not (return_logits or choose) else None
        for step in range(k):
            feature = self(feature, tok)
            if reduced is not None:  # greedy over the frequent tokens only
                ids, rows = reduced
                tok = ids[rows(feature.to(self.target.norm.weight.dtype)).argmax(dim=-1)]
                tokens.append(tok)
                continue
            step_logits = self.compute_logits(feature)
            tok = choose(step_logits, step) if choose else step_logits.argmax(dim=-1)
            tokens.append(tok)
            if return_logits:
                logits.append(step_logits)
        drafted = torch.stack(tokens, dim=1) if tokens else token_ids.new_empty(len(token_ids), 0)
        return drafted, torch.stack(logits, dim=1) if return_logits and logits else None

    # ---- disk --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `path/model.safetensors` (fp32) and `path/config.json`; returns the directory."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
        (out / CONFIG_FILE).write_text(json.dumps(self.config, indent=1) + "\n")
        return out

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        target_model: nn.Module,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> EagleHead:
        """A ready head bound to `target_model`, on `device` in `dtype` (default: the target's).
        ValueError when `path` holds no head, a damaged one, or one trained for another model."""
        root = Path(path).expanduser()
        cfg_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
        if not cfg_path.is_file() or not weights_path.is_file():
            raise ValueError(f"{root}: not a draft head directory (needs {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")  # fmt: skip
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{cfg_path}: unreadable draft head config ({e})") from e
        if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
            raise ValueError(f"{cfg_path}: not an inferd draft head config")
        if cfg.get("architecture") != ARCHITECTURE:
            raise ValueError(f"{cfg_path}: draft head architecture {cfg.get('architecture')!r} "
                             f"is not supported (this inferd reads {ARCHITECTURE!r})")  # fmt: skip
        try:
            sizes = [cfg[k] for k in ("hidden_size", "vocab_size", "num_blocks",
                                      "intermediate_size", "rms_norm_eps")]  # fmt: skip
            head = cls(*sizes, target=cfg.get("target"))
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
            head.to(device=device or ref.device, dtype=dtype or ref.dtype)
            .eval()
            .requires_grad_(False)
        )
        head.bind(target_model)
        return head.set_draft_vocab(draft_vocab.load(root, head.vocab_size))
