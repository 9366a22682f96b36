"""EAGLE-style learned draft head (EAGLE-1's shape): from the target's hidden state at position t
and the token at t + 1, predict the target's hidden state at t + 1, in the target's own space, so
that the target's LM head turns it into logits for the token at t + 2. Chaining k steps (feed the
predicted feature back with the drafted token) drafts k tokens for the target to verify in one
forward.

    x_t     = fc([norm_h(h_t), norm_e(embed(token_{t+1}))])
    feature = out_norm(y + mlp(norm(y))),  y = x_t + attention(norm(x_t) at t; keys/values of x_0..x_t)

The one attention layer looks back over the whole sequence: the keys and values of every earlier
position come from the target's true hidden states (a cache the engine keeps per sequence, see
inferd.spec.eagle), those of the chain's own earlier steps from the head's predictions. The
target's final hidden state mostly encodes its next token; the attention gives the head the
context it needs for the tokens after that (without it, the same recipe reached a mean acceptance
length of 1.6 on held-out chat, see README).

With `feature_layers` (EAGLE-3's low and middle features), wherever the head reads the target's
h_t it reads h_t + feature_fc([rms(l_t) for each such layer's output l_t]) instead
(`target_features`); the engine's target captures those rows in its forward.

The head borrows the target's embedding (`target.embed_tokens`) and LM head
(`target.compute_logits`); neither is saved with it. `out_norm` starts as a copy of the target's
final norm: the target's hidden states (which `LlamaForCausalLM.forward` returns after that norm)
live on its scale, and so do the predictions.

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

from inferd.sampling.sampler import argmax_rows
from inferd.spec import draft_vocab
from inferd.spec.draft_tree import SettledChains


def _draft_linear(weight: torch.Tensor) -> nn.Module:
    """An fp32 CPU weight [N, K] as the linear the engine's draft steps run: int4 in groups of 32
    (fp16 scale and min each) in the engine's packed tiles where the CPU takes them, else int8
    per output channel.

    Why int4: a draft step streams every weight of the head (13.6 MB in int8, most of it the
    draft vocabulary's LM head rows) from memory the target's forward has just swept, k times
    per target step. Against int8, on the bench's chat prompts (fp32 target, k = 3 every step,
    6 alternated runs): 1.34x against 1.26x over speculation off, with the offline acceptance
    length 1.9 % lower at worst (eval40 2.005 vs 2.018, free-form 1.830 vs 1.843, chat6 1.799 vs
    1.834). Drafts only rank tokens; verification scores the target's own logits."""
    from inferd.layers.quantized_linear import QuantizedLinear
    from inferd.quantization.formats import pack_tiles, quantize_int4, quantize_int8

    packed = pack_tiles(quantize_int4(weight)) if weight.shape[1] % 32 == 0 else None
    if packed is None:
        q = quantize_int8(weight)
        packed = pack_tiles(q) or q
    # Read k times a step, 7 MB in all: kept in cache, not streamed past it as a model's are.
    packed.streamed = False
    return QuantizedLinear(packed)


# A quantized draft vocabulary's scores within this of a step's best are rescored in fp32 (at most
# RESCORE_MAX of them): int4 rounding moved the default model's head's scores by up to ~1.7.
RESCORE_WITHIN = 2.0
RESCORE_MAX = 16
# A ranked chain's alternatives at each depth: the runner-up and the third likeliest token
# (csrc/eagle_draft.h kAlternatives, the same number).
ALTERNATIVES = 2

FORMAT = "inferd-eagle-head"
ARCHITECTURE = "fc-attn-v1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Rows of the target's embedding kept (first FINGERPRINT_DIMS values each) to recognise it later:
# the same model under another quantization matches within tolerance, another model does not.
FINGERPRINT_DIMS = 16
FINGERPRINT_MIN_COSINE = 0.98


def _runner_ups(
    scores: torch.Tensor, best: torch.Tensor, ext: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next ALTERNATIVES likeliest indices after `best` (each the first of the largest
    others left) [B, A] and the softmax probabilities of best and of them [B, 1 + A]:
    csrc/sampling_ops.h `runner_ups` (the C++ chain's, the same bits) when the kernels are there,
    else ATen's ops (equal within rounding)."""
    if ext is not None and scores.is_cpu and scores.dtype == torch.float32:
        return ext.runner_ups(scores, best, ALTERNATIVES)
    rest = scores.clone()
    picked = [best]
    for _ in range(ALTERNATIVES):
        rest.scatter_(1, picked[-1].unsqueeze(1), float("-inf"))
        picked.append(argmax_rows(rest))
    idx = torch.stack(picked, 1)
    lse = torch.logsumexp(scores, 1, keepdim=True)
    return idx[:, 1:], (scores.gather(1, idx) - lse).exp()


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


def check_feature_layers(layers: tuple[int, ...], num_layers: int) -> None:
    """ValueError unless `layers` (a head's feature layers) are distinct, ascending layers of a
    target with `num_layers` layers."""
    if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
        raise ValueError(f"feature layers must be distinct, ascending and >= 0: {list(layers)}")
    if layers and layers[-1] >= num_layers:
        raise ValueError(f"draft head reads target layers {list(layers)}; the target model has {num_layers}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout ([x1, x2] -> [x1·c - x2·s, x2·c + x1·s]), in plain
    differentiable ops (training runs through it). cos, sin: [..., D/2], broadcast over heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DraftCache:
    """The keys and values of one sequence's true positions [lo, end) (from the target's hidden
    states), in buffers that grow by doubling; `x_last` is the head's input at end - 1, where
    the next chain of drafts starts."""

    __slots__ = ("end", "k", "lo", "v", "x_last")

    def __init__(self, like: torch.Tensor, kv_heads: int, head_dim: int) -> None:
        self.k = like.new_empty((16, kv_heads, head_dim))
        self.v = like.new_empty((16, kv_heads, head_dim))
        self.lo = self.end = 0
        self.x_last: torch.Tensor | None = None

    def write(self, start: int, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries for positions [start, start + len(k)). Writing at or before `end` overwrites
        from there (a recomputation after preemption); a gap starts the cache afresh at `start`
        (positions the target did not compute, e.g. a prefix served from its cache)."""
        if start > self.end or start < self.lo:
            self.lo = self.end = start
        n = len(k)
        need = start + n - self.lo
        self.end = min(self.end, start)  # rows from `start` on are replaced
        self.reserve(need - (self.end - self.lo))
        self.k[start - self.lo : need] = k
        self.v[start - self.lo : need] = v
        self.end = start + n
        self.x_last = x[-1]

    def reserve(self, extra: int) -> None:
        """Room for `extra` rows after `end` (a draft chain writes its own keys there)."""
        need = self.end - self.lo + extra
        if need > len(self.k):
            cap = max(need, 2 * len(self.k))
            grown_k, grown_v = self.k.new_empty((cap, *self.k.shape[1:])), self.v.new_empty((cap, *self.v.shape[1:]))
            used = self.end - self.lo
            grown_k[:used], grown_v[:used] = self.k[:used], self.v[:used]
            self.k, self.v = grown_k, grown_v

    def copy(self) -> DraftCache:
        other = DraftCache.__new__(DraftCache)
        other.k, other.v = self.k.clone(), self.v.clone()
        other.lo, other.end, other.x_last = self.lo, self.end, self.x_last
        return other

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.end - self.lo
        return self.k[:n], self.v[:n]


class EagleHead(nn.Module):
    """The draft head. `bind(target)` (done by `load`) lends it the target's embedding and LM head
    (training binds the fp32 copy of the target, which autograd can run through)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int | None = None,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        target: dict[str, Any] | None = None,
        feature_layers: tuple[int, ...] | list[int] = (),
    ) -> None:
        super().__init__()
        if (hidden_size <= 0 or vocab_size <= 0 or num_heads <= 0 or num_kv_heads <= 0
                or hidden_size % num_heads or num_heads % num_kv_heads
                or (hidden_size // num_heads) % 2):  # fmt: skip
            raise ValueError(f"bad draft head sizes: hidden {hidden_size}, vocab {vocab_size}, "
                             f"heads {num_heads}, kv heads {num_kv_heads}")  # fmt: skip
        inter = intermediate_size or 2 * hidden_size
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.intermediate_size, self.rms_norm_eps, self.rope_theta = inter, rms_norm_eps, rope_theta
        self.target_info = dict(target or {})
        self.feature_layers = tuple(int(i) for i in feature_layers)
        check_feature_layers(self.feature_layers, 1 << 62)  # the target's count: checked by `bind`
        d, kv = self.head_dim, num_kv_heads * self.head_dim
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.embed_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        if self.feature_layers:
            # EAGLE-3's extra features: the outputs of lower target layers (each RMS-normalised),
            # projected and added to the final hidden state wherever the head reads the target's.
            # Zero at init: the head starts as the one without them.
            self.feature_fc = nn.Linear(len(self.feature_layers) * hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.feature_fc.weight)
        self.attn_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.qkv = nn.Linear(hidden_size, num_heads * d + 2 * kv, bias=False)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.gate_up = nn.Linear(hidden_size, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden_size, bias=False)
        self.out_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        # Small residual branches at init: the layer starts near the identity.
        nn.init.normal_(self.o_proj.weight, std=0.02 / math.sqrt(2))
        nn.init.normal_(self.down.weight, std=0.02 / math.sqrt(2))
        # fp64, outside the module's buffers: `.to(dtype)` must not round it.
        self.__dict__["_inv_freq"] = 1.0 / rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        # The bound target, outside the module tree: never saved, moved or trained with the head.
        self.__dict__["_target"] = None
        # (token ids [N], LM head over those rows) when drafting over a reduced vocabulary.
        self.__dict__["_draft_vocab"] = None
        # The target's fp32 LM head (the module) where those rows are a quantized copy of it:
        # drafting rescores each step's close candidates against it (`_rescore_close`).
        self.__dict__["_exact_from"] = None
        # The C++ CPU kernels once `for_inference` has set the head up for them (None: plain ops).
        self.__dict__["_kernels"] = None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target: nn.Module, **kwargs: Any) -> EagleHead:
        """A fresh head sized for `target` (its attention heads of the target's width), its output
        norm copied from the target's final norm."""
        cfg = target.config
        kwargs.setdefault("rms_norm_eps", cfg.rms_norm_eps)
        kwargs.setdefault("rope_theta", cfg.rope_theta)
        kwargs.setdefault("num_heads", cfg.num_heads)
        kwargs.setdefault("num_kv_heads", cfg.num_kv_heads)
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
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "feature_layers": list(self.feature_layers),
            "target": self.target_info,
        }

    def bind(self, target: nn.Module) -> EagleHead:
        """Use `target`'s embedding and LM head from now on (no copy); checks it is the one the
        head was trained for."""
        if self.target_info:
            check_target(self.target_info, target)
        check_feature_layers(self.feature_layers, target.config.num_layers)
        self.__dict__["_target"] = target
        self.__dict__["_fused"] = None
        return self

    def set_draft_vocab(self, ids: torch.Tensor | None) -> EagleHead:
        """Draft over these token ids only (inferd.spec.draft_vocab; None: the whole vocabulary):
        greedy drafting scores just their rows of the target's LM head. The rows are copied once
        (quantized heads stay quantized); training and `return_logits` still see every token."""
        self.__dict__["_exact_from"] = None
        if ids is None:
            self.__dict__["_draft_vocab"] = None
            self.__dict__["_fused"] = None
            return self
        from inferd.layers.quantized_linear import QuantizedLinear

        lm_head = self.target.lm_head
        if isinstance(lm_head, QuantizedLinear):
            from inferd.quantization.formats import pack_tiles

            picked = lm_head.qweight.rows(ids.cpu()).to(ids.device)
            # The engine's packed tiles where the rows take them (int8 / int4 blocks on the CPU):
            # the row layout ran at a third of their speed, the largest part of a draft step.
            rows: nn.Module = QuantizedLinear(pack_tiles(picked) or picked)
        else:
            picked = lm_head.weight.detach()[ids.to(lm_head.weight.device)]
            if isinstance(self.fc, QuantizedLinear) and picked.dtype == torch.float32:
                # An fp32 target under a quantized head (`for_inference(quantize=True)`): its rows
                # quantized as the head's linears. In fp32 they were 38 MB a draft, over half of a
                # k = 3 chain's 5.5 ms; drafts only rank the tokens, verification scores the
                # target's own fp32 logits.
                rows = _draft_linear(picked)
                self.__dict__["_exact_from"] = lm_head
            else:
                rows = nn.Linear(picked.shape[1], len(ids), bias=False, device=picked.device,
                                 dtype=picked.dtype).requires_grad_(False)  # fmt: skip
                rows.weight.copy_(picked)
        self.__dict__["_draft_vocab"] = (ids.to(self.target.norm.weight.device), rows)
        self.__dict__["_fused"] = None
        return self

    def gather_weights(self) -> EagleHead:
        """The head's weights and its draft-vocabulary rows in one block of 2 MiB pages
        (inferd/layers/weight_arena.py). A chain reads them k times right after the target's
        forward has swept the caches and the TLB: as ~1,800 pages of 4 KiB each was a page walk
        there; as 4 huge pages they stay mapped."""
        from inferd.layers.weight_arena import gather_weights

        extra = [self._draft_vocab[1]] if self._draft_vocab is not None else []
        if gather_weights([self, *extra]):
            self.__dict__["_fused"] = None  # the C++ chains' weights: rebuilt from the moved ones
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

    def for_inference(self, quantize: bool) -> EagleHead:
        """Swap the layers for the engine's inference ones, in place (no training after this):
        RMSNorms and linears with the C++ kernels the target's decode step runs, the linears
        quantized (`_draft_linear`: int4 in the engine's packed tiles) when `quantize`. A draft
        step reads every weight of the head once; in fp32 (16 MiB at the default size) that
        streaming was most of its time, and the chain runs it k times per target step."""
        from inferd.layers.linear import Linear
        from inferd.layers.norm import RMSNorm

        for name, module in list(self.named_children()):
            if isinstance(module, nn.RMSNorm):
                norm = RMSNorm(self.hidden_size, self.rms_norm_eps).to(module.weight.device)
                norm.weight.data = module.weight.data.float()
                setattr(self, name, norm)
            elif isinstance(module, nn.Linear):
                w = module.weight.data
                if quantize and w.is_cpu:
                    setattr(self, name, _draft_linear(w))
                else:
                    lin = Linear(w.shape[1], w.shape[0]).to(w.device)
                    lin.weight.data = w
                    setattr(self, name, lin)
        from inferd.kernels.quant_gemm import extension

        ext = extension() if self.out_norm.weight.is_cpu and self.out_norm.weight.dtype == torch.float32 else None
        # The draft step's elementwise ops and its attention as the target's decode step runs
        # them (csrc/layer_ops.h, paged_attention.h): one C++ call each instead of ~30 small ATen
        # ops, most of a draft step's time at batch 1.
        self.__dict__["_kernels"] = ext
        self.__dict__["_fused"] = None
        return self

    @property
    def input_size(self) -> int:
        """Width of the target rows the head reads: the final hidden state, then each feature
        layer's output (`LlamaForCausalLM.captured`), H each."""
        return self.hidden_size * (1 + len(self.feature_layers))

    def target_features(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's view [..., H] of the target's rows [..., input_size]: the final hidden state,
        plus the projected feature layers' outputs when the head reads them."""
        if not self.feature_layers:
            return rows
        h, n = self.hidden_size, len(self.feature_layers)
        ext = self._kernels
        if ext is not None and rows.dim() == 2 and rows.dtype == torch.float32:
            # The engine's rows: one C++ norm over every feature instead of six ATen ops.
            ones = self.__dict__.get("_feature_norm_ones")
            if ones is None:
                ones = self.__dict__["_feature_norm_ones"] = rows.new_ones(h)
            extra = ext.rms_norm(rows[:, h:].reshape(-1, h), ones, self.rms_norm_eps)
            return rows[:, :h] + self.feature_fc(extra.view(len(rows), n * h))
        dtype = self.out_norm.weight.dtype
        extra = rows[..., h:].unflatten(-1, (n, h)).to(dtype)
        # The residual stream's scale grows with depth (|x| ~ 10-100 in the default model).
        extra = extra * torch.rsqrt(extra.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps)
        return rows[..., :h].to(dtype) + self.feature_fc(extra.flatten(-2))

    # ---- the layer's pieces (any leading shape) ----------------------------------------------
    def inputs(
        self,
        hidden: torch.Tensor,  # [..., H] target hidden state at t (or the head's prediction of it)
        token_ids: torch.Tensor,  # [...] token at t + 1
        embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The layer's input x_t [..., H] in the head's dtype."""
        embed = embed_fn or self.target.embed_tokens
        dtype = self.out_norm.weight.dtype
        e = embed(token_ids).to(dtype)
        return self.fc(torch.cat([self.hidden_norm(hidden.to(dtype)), self.embed_norm(e)], dim=-1))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, D/2] at `positions`, from a table computed in fp64 and grown (to the
        next power of two) as positions get larger: one lookup per step at inference."""
        table = self.__dict__.get("_rope_table")
        top = int(positions.max()) + 1 if positions.numel() else 1
        if table is None or len(table[0]) < top or table[0].dtype != dtype or table[0].device != positions.device:
            size = 1 << max(top - 1, 255).bit_length()
            freqs = torch.arange(size, dtype=torch.float64).unsqueeze(-1) * self._inv_freq
            table = (freqs.cos().to(dtype).to(positions.device), freqs.sin().to(dtype).to(positions.device))
            self.__dict__["_rope_table"] = table
        return table[0][positions].unsqueeze(-2), table[1][positions].unsqueeze(-2)

    def _rope_full(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] at 1-D `positions` in the engine's full-width layout (x·cos +
        swap_halves(x)·sin, the first half of sin negated): what the C++ rotary takes."""
        top = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._rope_full_table(top, positions.device)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def _rope_full_table(self, top: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [P, D] of `_rope_full`, grown to reach position top - 1. The C++
        chain and cache entries index them themselves: before, each call also gathered the rows
        of its positions and threw them away."""
        table = self.__dict__.get("_rope_full_cache")
        if table is None or len(table[0]) < top:
            size = 1 << max(top - 1, 255).bit_length()  # grown to the next power of two
            cos, sin = self._rope(torch.arange(size, device=device), torch.float32)
            cos, sin = cos.squeeze(-2), sin.squeeze(-2)
            table = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
            self.__dict__["_rope_full_cache"] = table
        return table

    def qkv_of(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated queries [..., NH, D], keys [..., KVH, D] and values [..., KVH, D] of x at
        `positions` (shaped like x without its last dimension)."""
        d, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        ext = self._kernels
        if ext is not None and x.dim() == 2:
            qkv = self.qkv(self.attn_norm(x))
            cos, sin = self._rope_full(positions)
            qk = ext.rotary(qkv[:, : (nh + nkv) * d].view(-1, nh + nkv, d), cos, sin)
            return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * d :].view(-1, nkv, d)
        q, k, v = self.qkv(self.attn_norm(x)).split([nh * d, nkv * d, nkv * d], dim=-1)
        cos, sin = self._rope(positions, x.dtype)
        q = rotate(q.unflatten(-1, (nh, d)), cos, sin)
        k = rotate(k.unflatten(-1, (nkv, d)), cos, sin)
        return q, k, v.unflatten(-1, (nkv, d))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output feature [..., H] from its input x and the attention [..., NH, D]."""
        ext = self._kernels
        if ext is not None and x.dim() == 2:
            eps = self.rms_norm_eps
            y, h = ext.add_rms_norm(x, self.o_proj(attn.flatten(-2)), self.mlp_norm.weight, eps)
            return ext.add_rms_norm(y, self.down(ext.silu_mul(self.gate_up(h))), self.out_norm.weight, eps)[1]
        y = x + self.o_proj(attn.flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(y)).chunk(2, dim=-1)
        return self.out_norm(y + self.down(F.silu(gate) * up))

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] of the target's LM head applied to predicted features."""
        target = self.target
        return target.compute_logits(feature.to(target.norm.weight.dtype))

    def _draft_scores(self, feature: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Greedy drafting's scores of each feature [B, H]: over the draft vocabulary (its token
        ids first) when one is set, else the whole vocabulary's logits (ids None)."""
        if self._draft_vocab is not None:
            ids, rows = self._draft_vocab
            feature = feature.to(self.target.norm.weight.dtype)
            scores = rows(feature)
            if self._exact_from is not None:
                self._rescore_close(scores, feature, ids)
            return ids, scores
        return None, self.compute_logits(feature)

    def _rescore_close(
        self, scores: torch.Tensor, feature: torch.Tensor, ids: torch.Tensor
    ) -> None:
        """In place: each row's scores within RESCORE_WITHIN of its max (at most RESCORE_MAX of
        them) replaced by the target's fp32 LM head's (csrc/eagle_draft.h `rescore_close`, the C++
        chain's, the same bits; without the kernels, ATen's, equal within rounding)."""
        table = self._exact_from.weight.detach()
        rows = scores.view(-1, scores.shape[-1])  # a linear's fresh output: a view, written through
        x = feature.reshape(-1, feature.shape[-1]).contiguous()
        ext = self._kernels
        if ext is not None and scores.is_cpu:
            ids = ids.long().contiguous()
            ext.eagle_rescore_close(rows, x, ids, table, RESCORE_WITHIN, RESCORE_MAX)
            return
        top, at = rows.topk(min(RESCORE_MAX, rows.shape[-1]), dim=-1)
        close = top >= rows.max(-1, keepdim=True).values - RESCORE_WITHIN
        exact = torch.einsum("bh,bch->bc", x.float(), table[ids[at]].float())
        rows.scatter_(-1, at, torch.where(close, exact.to(top.dtype), top))

    def greedy(self, feature: torch.Tensor) -> torch.Tensor:
        """The draft token of each feature [..., H]: argmax of the target's LM head, over the
        draft vocabulary when one is set (what greedy drafting picks)."""
        ids, scores = self._draft_scores(feature)
        best = argmax_rows(scores)
        return best if ids is None else ids[best]

    def greedy_top(self, feature: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy`'s tokens [B] and the n likeliest others after each [B, n], from one scoring."""
        ids, scores = self._draft_scores(feature)
        best = argmax_rows(scores)
        top = scores.topk(n + 1, dim=-1).indices
        others = top[:, 1:]
        tie = top[:, 0] != best
        if bool(tie.any()):  # topk broke a tie otherwise than argmax: drop `best` from those rows
            others = others.clone()
            others[tie] = torch.stack([r[r != b][:n] for r, b in zip(top[tie], best[tie])])
        if ids is not None:
            best, others = ids[best], ids[others]
        return best, others

    # ---- training: every position of whole sequences at once ---------------------------------
    def forward_levels(
        self,
        hidden: torch.Tensor,  # [B, T, H] the target's hidden states
        tokens: torch.Tensor,  # [B, T]
        lengths: torch.Tensor,  # [B] real length of each (padded) sequence
        levels: int,
        embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The features [B, T - 1, H] of `levels` chained steps, drafting from every position at
        once, each position p of level l (l = 0..levels-1) computed as the engine would at chain
        step l + 1 from start t = p - l: its input pairs level l - 1's prediction at p - 1 with the
        true token p + 1 (at level 0, the target's h_p), and its attention sees the true keys of
        positions <= t plus the chain's own keys at t + 1..p (one from each earlier level). Rows
        of level l predict the target's hidden state at p + 1; those with p < l are meaningless.
        Up to the first wrong draft, drafted tokens are the true ones, so these are exactly the
        features the engine's chains compute: training and the offline acceptance both use it."""
        if int(lengths.min()) < 2:
            raise ValueError("every sequence needs at least 2 tokens")
        hidden = self.target_features(hidden)
        b, t1 = hidden.shape[0], hidden.shape[1] - 1
        pos = torch.arange(t1, device=hidden.device)
        positions = pos.expand(b, t1)
        key_ok = pos[None, :] < (lengths[:, None] - 1)  # [B, T-1] a real position with a next token
        scale = self.head_dim ** -0.5
        group = self.num_heads // self.num_kv_heads
        feats: list[torch.Tensor] = []
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # per level: [B, T-1, KVH, D] each
        prev = hidden[:, :-1]
        for level in range(levels):
            if level == 0:
                x = self.inputs(prev, tokens[:, 1:], embed_fn)
            else:  # prediction of h_p from position p - 1, with the token at p + 1
                shifted = torch.cat([prev[:, :1], prev[:, :-1]], dim=1)
                x = self.inputs(shifted, tokens[:, 1:], embed_fn)
            q, k, v = self.qkv_of(x, positions)
            keys.append((k, v))
            q = q.transpose(1, 2)  # [B, NH, T-1, D]
            k0 = keys[0][0].repeat_interleave(group, dim=2).transpose(1, 2)
            v0 = keys[0][1].repeat_interleave(group, dim=2).transpose(1, 2)
            scores = (q @ k0.transpose(-1, -2)) * scale  # [B, NH, Tq, Tk]
            visible = (pos[None, :] <= pos[:, None] - level) & key_ok[:, None, :]  # [B, Tq, Tk]
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            extra_s, extra_v = [], []
            for m in range(1, level + 1):  # the chain's own key from level m, at p - level + m
                km, vm = keys[m]
                lag = level - m
                km = km.repeat_interleave(group, dim=2).transpose(1, 2)
                vm = vm.repeat_interleave(group, dim=2).transpose(1, 2)
                if lag:
                    km = torch.cat([km[:, :, :1].expand(-1, -1, lag, -1), km[:, :, :-lag]], dim=2)
                    vm = torch.cat([vm[:, :, :1].expand(-1, -1, lag, -1), vm[:, :, :-lag]], dim=2)
                extra_s.append((q * km).sum(-1, keepdim=True) * scale)  # [B, NH, Tq, 1]
                extra_v.append(vm)
            # Rows p < level see no true key, but their chain's own keys keep the softmax finite
            # (their outputs are never used); at level 0 every row sees position 0.
            scores = torch.cat([scores, *extra_s], dim=-1)
            probs = torch.softmax(scores, dim=-1)
            out = probs[..., :t1] @ v0  # [B, NH, Tq, D]
            for i, vm in enumerate(extra_v):
                out = out + probs[..., t1 + i : t1 + i + 1] * vm
            feature = self.finish(x, out.transpose(1, 2))
            feats.append(feature)
            prev = feature
        return feats

    # ---- inference: chains from the engine's caches ------------------------------------------
    @torch.no_grad()
    def cache_entries(
        self,
        hidden: torch.Tensor,  # [N, input_size] the target's rows at `positions`
        next_tokens: torch.Tensor,  # [N] the token after each position
        positions: torch.Tensor,  # [N]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [N, H], keys [N, KVH, D], values [N, KVH, D]) of true positions, for DraftCache."""
        hidden = self.target_features(hidden)
        fused = self._fused_weights()
        if fused is not None and hidden.dim() == 2 and hidden.dtype == torch.float32:
            top = int(positions.max()) + 1 if len(positions) else 1
            cos, sin = self._rope_full_table(top, positions.device)  # reaching every position
            return self._kernels.eagle_cache_entries(
                fused, self._fused_shape(), hidden.contiguous(), next_tokens, positions, cos, sin
            )
        x = self.inputs(hidden, next_tokens)
        _, k, v = self.qkv_of(x, positions)
        return x, k, v

    @torch.no_grad()
    def draft(
        self,
        caches: list[DraftCache],
        k: int,
        return_logits: bool = False,
        choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        alternatives: int = 0,
        confidences: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """Chains of k drafted tokens [B, k], one per cache, each from the cache's last position t
        (tokens t + 2 .. t + k + 1), and, when asked, the logits each was drafted from [B, k, V]
        fp32 (what rejection sampling needs as q). Every cache must hold a position.

        `choose(logits [B, V], step) -> tokens [B]` picks each drafted token (at temperature > 0:
        sample from the processed distribution); default greedy (argmax).

        `alternatives` > 0 (greedy drafting only): the second value is instead, per chain and
        step, the next `alternatives` likeliest tokens after the drafted one [B, k, alternatives]
        (a draft tree's leaves).

        `confidences` (greedy drafting only): the second value is instead (alternative tokens
        [B, k, A], probabilities [B, k, 1 + A], A = ALTERNATIVES): at each step the next A
        likeliest tokens after the drafted one, and the softmax probability (over the draft
        vocabulary when one is set) of the drafted token and of each, by which a draft tree ranks
        its nodes
        (inferd.spec.draft_tree); the chains then stop once no deeper draft could be among any
        chain's k likeliest nodes (`SettledChains`), so all three may hold fewer than k steps."""
        greedy = not (return_logits or choose)
        assert greedy or not (alternatives or confidences), "alternatives, confidences: greedy only"
        assert not (alternatives and confidences), "alternatives or confidences, not both"
        if greedy and not alternatives and k > 0:
            fused = self._fused_weights()
            if fused is not None:
                tokens, seconds, probs = self._draft_fused(fused, caches, k, confidences)
                return tokens, (seconds, probs) if confidences else None
        alts, seconds, probs = [], [], []
        settled = SettledChains(len(caches), k) if confidences else None
        b = len(caches)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        group, scale = nh // nkv, d**-0.5
        for c in caches:  # each chain writes its own keys after the cache's true ones
            c.reserve(k)
        x = torch.stack([c.x_last for c in caches])  # [B, H]
        pos = torch.tensor([c.end - 1 for c in caches], device=x.device)
        tokens, logits = [], []
        ext = self._kernels
        if ext is not None:  # the target's paged attention kernel, each cache one block of its own
            zero = torch.zeros(1, dtype=torch.long)
            one, table = zero + 1, zero.view(1, 1)
        for step in range(k):
            q, kk, vv = self.qkv_of(x, pos)
            if step > 0:  # each chain's key and value from its previous step, after the true ones
                for i, c in enumerate(caches):
                    n = c.end - c.lo + step
                    c.k[n - 1], c.v[n - 1] = kk[i], vv[i]
            if ext is not None:
                attn = torch.empty(b, nh, d)
                q = q.contiguous()
                for i, c in enumerate(caches):
                    n = c.end - c.lo + step
                    ext.paged_attention_short(q[i : i + 1], c.k.unsqueeze(0), c.v.unsqueeze(0), zero, one,
                                              torch.tensor([n]), table, attn[i : i + 1], scale)  # fmt: skip
            else:
                outs = []
                for i, c in enumerate(caches):  # one query per sequence over its own keys
                    n = c.end - c.lo + step
                    keys, values = c.k[:n].transpose(0, 1), c.v[:n].transpose(0, 1)  # [KVH, n, D]
                    s = torch.matmul(q[i].view(nkv, group, d), keys.transpose(1, 2)).mul_(scale)
                    outs.append(torch.matmul(torch.softmax(s, dim=-1), values))  # [KVH, G, D]
                attn = torch.stack(outs).view(b, nh, d)
            feature = self.finish(x, attn)
            if alternatives:
                tok, alt = self.greedy_top(feature, alternatives)
                alts.append(alt)
            elif confidences:
                ids, scores = self._draft_scores(feature)
                best = argmax_rows(scores)
                others, prob = _runner_ups(scores, best, self._kernels)
                tok, others = (best, others) if ids is None else (ids[best], ids[others])
                seconds.append(others)
                probs.append(prob)
                if step + 1 < k and settled.step(prob):  # no deeper draft could be verified
                    tokens.append(tok)
                    break
            elif not (return_logits or choose):
                tok = self.greedy(feature)
            else:
                step_logits = self.compute_logits(feature)
                tok = choose(step_logits, step) if choose else argmax_rows(step_logits)
                if return_logits:
                    logits.append(step_logits)
            tokens.append(tok)
            if step + 1 < k:
                x = self.inputs(feature, tok)
                pos = pos + 1
        drafted = torch.stack(tokens, dim=1) if tokens else pos.new_empty(b, 0)
        if alternatives:
            return drafted, torch.stack(alts, dim=1) if alts else pos.new_empty(b, 0, alternatives)
        if confidences:
            if not seconds:
                empty = pos.new_empty(b, 0, ALTERNATIVES), x.new_empty(b, 0, 1 + ALTERNATIVES)
                return drafted, empty
            return drafted, (torch.stack(seconds, dim=1), torch.stack(probs, dim=1))
        return drafted, torch.stack(logits, dim=1) if return_logits and logits else None

    def _fused_weights(self) -> Any:
        """The head as the C++ chain takes it (csrc/eagle_draft.h), built once; None where that
        chain would not run the Python one's kernels: linears other than quantized ones without
        bias (packed tiles where int8 activations are on, or the row layout: an AVX2-only CPU's,
        with fp32 activations), no draft vocabulary, an embedding neither fp32 nor quantized."""
        cached = self.__dict__.get("_fused")
        if cached is not None:
            return cached or None
        from inferd.layers.linear import Embedding
        from inferd.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
        from inferd.models.llama import kernel_linear_weights
        from inferd.quantization import formats

        ext, fused = self._kernels, False
        int8 = ext is not None and formats.int8_activations_default(ext)

        def same_kernel(m: nn.Module) -> bool:
            # decoder::linear dispatches a quantized weight as quantized_matmul does; packed
            # tiles under fp32 activations are dequantised in Python instead, so not those.
            return (isinstance(m, QuantizedLinear) and m.bias is None
                    and (m.qweight.layout == "rows" or int8))  # fmt: skip

        linears = [self.fc, self.qkv, self.o_proj, self.gate_up, self.down]
        if self._draft_vocab is not None:
            linears.append(self._draft_vocab[1])
        embed = self.target.embed_tokens if self._target is not None else None
        table = (isinstance(embed, Embedding) and embed.weight.dtype == torch.float32) or (
            isinstance(embed, QuantizedEmbedding) and embed.dtype == torch.float32
            and (embed.qweight.layout == "rows" or int8)  # fmt: skip
        )
        if ext is not None and len(linears) == 6 and all(map(same_kernel, linears)) and table:
            norms = [n.weight for n in (self.hidden_norm, self.embed_norm, self.attn_norm,
                                        self.mlp_norm, self.out_norm)]  # fmt: skip
            kinds = [kernel_linear_weights(ext, m) for m in linears]
            exact = {}
            if self._exact_from is not None:
                exact = {"exact": self._exact_from.weight.detach(), "exact_within": RESCORE_WITHIN,
                         "exact_max": RESCORE_MAX}  # fmt: skip
            fused = ext.EagleHeadWeights(norms, kinds, self._draft_vocab[0].long(),
                                         kernel_linear_weights(ext, embed), **exact)  # fmt: skip
        self.__dict__["_fused"] = fused
        return fused or None

    def _fused_shape(self) -> Any:
        shape = self.__dict__.get("_kernel_shape")
        if shape is None:
            from inferd.quantization import formats

            shape = self._kernels.DecoderShape(self.num_heads, self.num_kv_heads, self.head_dim,
                                               self.intermediate_size, self.rms_norm_eps,
                                               self.head_dim**-0.5,
                                               formats.int8_activations_default(self._kernels))  # fmt: skip
            self.__dict__["_kernel_shape"] = shape
        return shape

    def _draft_fused(
        self, fused: Any, caches: list[DraftCache], k: int, confidences: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draft`'s greedy chains in one C++ call: the same tokens, the same keys left behind;
        (tokens, runner-ups, probabilities), the last two empty unless `confidences`."""
        for c in caches:
            c.reserve(k)
        x = torch.stack([c.x_last for c in caches])
        ends = [c.end - 1 for c in caches]
        pos = torch.tensor(ends)
        cos, sin = self._rope_full_table(max(ends) + k, pos.device)  # reaching every chain position
        return self._kernels.eagle_draft_chains(
            fused, self._fused_shape(), x, pos, [c.k for c in caches], [c.v for c in caches],
            [c.end - c.lo for c in caches], cos, sin, k, confidences,
        )  # fmt: skip

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
        quantize: bool = False,
    ) -> EagleHead:
        """A ready head bound to `target_model`, on `device` in `dtype` (default: the target's);
        with `quantize`, its linears int4 (`for_inference`; fp32 CPU only). ValueError when
        `path` holds no head, a damaged one, or one trained for another model."""
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
            sizes = [cfg[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads",
                                      "intermediate_size", "rms_norm_eps", "rope_theta")]  # fmt: skip
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
            head.to(device=device or ref.device, dtype=dtype or ref.dtype)
            .eval()
            .requires_grad_(False)
        )
        head.bind(target_model)
        if head.fc.weight.dtype == torch.float32 and head.fc.weight.is_cpu:
            head.for_inference(quantize)
        head.set_draft_vocab(draft_vocab.load(root, head.vocab_size))
        return head.gather_weights() if ref.is_cpu else head
