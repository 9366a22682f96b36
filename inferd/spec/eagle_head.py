"""EAGLE-style learned draft head (EAGLE-1's shape): from the target's hidden state at position t
and the token at t + 1, predict the target's hidden state at t + 1, in the target's own space, so
that the target's LM head turns it into logits for the token at t + 2. Chaining k steps (feed the
predicted feature back with the drafted token) drafts k tokens for the target to verify in one
forward.

    x_t     = fc([norm_h(h_t), norm_e(embed(token_{t+1}))])
    y       = x_t + attention(norm(x_t) at t; keys/values of x_0..x_t)
    feature = out_norm(y + mlp(norm(y)))

The one attention layer looks back over the whole sequence: the keys and values of every earlier
position come from the target's true hidden states (a `DraftCache` the engine keeps per sequence,
see inferd.spec.eagle), those of the chain's own earlier steps from the head's predictions. The
target's final hidden state mostly encodes its next token; the attention gives the head the
context it needs for the tokens after that.

With `feature_layers` (EAGLE-3's low and middle features), wherever the head reads the target's
h_t it reads h_t + feature_fc([rms(l_t) for each such layer's output l_t]) instead
(`target_features`); the engine's target captures those rows in its forward.

The head borrows the target's embedding (`target.embed_tokens`) and LM head
(`target.compute_logits`); neither is saved with it. `out_norm` starts as a copy of the target's
final norm: the target's hidden states (which `LlamaForCausalLM.forward` returns after that norm)
live on its scale, and so do the predictions.

This module holds the layer and the engine's chains (`cache_entries`, `draft`). Around it:
inferd.spec.eagle_io (the directory on disk, the target's identity), inferd.spec.eagle_kernels
(quantized layers and the C++ chain), inferd.spec.draft_vocab (the reduced vocabulary greedy
drafting scores) and, for training only, inferd.train.head_levels (the chains unrolled over whole
sequences).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inferd.sampling.sampler import argmax_rows
from inferd.spec import eagle_io, eagle_kernels
from inferd.spec.draft_cache import DraftCache
from inferd.spec.draft_tree import SettledChains
from inferd.spec.eagle_io import check_feature_layers, check_target, target_identity
from inferd.spec.eagle_kernels import ALTERNATIVES


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout ([x1, x2] -> [x1·c - x2·s, x2·c + x1·s]), in plain
    differentiable ops (training runs through it). cos, sin: [..., D/2], broadcast over heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        if (
            hidden_size <= 0
            or vocab_size <= 0
            or num_heads <= 0
            or num_kv_heads <= 0
            or hidden_size % num_heads
            or num_heads % num_kv_heads
            or (hidden_size // num_heads) % 2
        ):
            raise ValueError(
                f"bad draft head sizes: hidden {hidden_size}, vocab {vocab_size}, "
                f"heads {num_heads}, kv heads {num_kv_heads}"
            )
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
            self.feature_fc = nn.Linear(
                len(self.feature_layers) * hidden_size, hidden_size, bias=False
            )
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
        self.__dict__["_inv_freq"] = 1.0 / rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float64) / d
        )
        # The bound target, outside the module tree: never saved, moved or trained with the head.
        self.__dict__["_target"] = None
        # (token ids [N], LM head over those rows) when drafting over a reduced vocabulary.
        self.__dict__["_draft_vocab"] = None
        # The target's fp32 LM head (the module) where those rows are a quantized copy of it:
        # drafting rescores each step's close candidates against it (`eagle_kernels.rescore_close`).
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
            "format": eagle_io.FORMAT,
            "architecture": eagle_io.ARCHITECTURE,
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
            # these rows are the largest part of a draft step, and the tiles' kernels read them
            # faster than the row layout's.
            rows: nn.Module = QuantizedLinear(pack_tiles(picked) or picked)
        else:
            picked = lm_head.weight.detach()[ids.to(lm_head.weight.device)]
            if isinstance(self.fc, QuantizedLinear) and picked.dtype == torch.float32:
                # An fp32 target under a quantized head (`for_inference(quantize=True)`): its rows
                # quantized as the head's linears, since in fp32 they would be most of the bytes a
                # draft step reads. Drafts only rank the tokens (the closest ones are rescored in
                # fp32), and verification scores the target's own fp32 logits.
                rows = eagle_kernels.draft_linear(picked)
                self.__dict__["_exact_from"] = lm_head
            else:
                rows = nn.Linear(
                    picked.shape[1], len(ids), bias=False, device=picked.device, dtype=picked.dtype
                ).requires_grad_(False)
                rows.weight.copy_(picked)
        self.__dict__["_draft_vocab"] = (ids.to(self.target.norm.weight.device), rows)
        self.__dict__["_fused"] = None
        return self

    def gather_weights(self) -> EagleHead:
        """The head's weights and its draft-vocabulary rows in one block of 2 MiB pages
        (inferd/layers/weight_arena.py). A chain reads them k times right after the target's
        forward has swept the caches and the TLB: spread over thousands of 4 KiB pages, each
        would cost a page walk there; a few huge pages stay mapped."""
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
        the C++ kernels the target's decode step runs, the linears int4 when `quantize`
        (inferd.spec.eagle_kernels)."""
        eagle_kernels.use_inference_layers(self, quantize)
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
        # The residual stream's scale grows with depth: each layer's output is normalised before
        # the projection so that no layer dominates by magnitude alone.
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

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, D/2] at `positions`, from a table computed in fp64 and grown (to the
        next power of two) as positions get larger: one lookup per step at inference."""
        table = self.__dict__.get("_rope_table")
        top = int(positions.max()) + 1 if positions.numel() else 1
        if (
            table is None
            or len(table[0]) < top
            or table[0].dtype != dtype
            or table[0].device != positions.device
        ):
            size = 1 << max(top - 1, 255).bit_length()
            freqs = torch.arange(size, dtype=torch.float64).unsqueeze(-1) * self._inv_freq
            table = (
                freqs.cos().to(dtype).to(positions.device),
                freqs.sin().to(dtype).to(positions.device),
            )
            self.__dict__["_rope_table"] = table
        return table[0][positions].unsqueeze(-2), table[1][positions].unsqueeze(-2)

    def _rope_full(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] at 1-D `positions` in the engine's full-width layout (x·cos +
        swap_halves(x)·sin, the first half of sin negated): what the C++ rotary takes."""
        top = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.rope_full_table(top, positions.device)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def rope_full_table(self, top: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [P, D] of `_rope_full`, grown to reach position top - 1: the
        C++ chain and cache entries take the tables and index them themselves."""
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
            return ext.add_rms_norm(
                y, self.down(ext.silu_mul(self.gate_up(h))), self.out_norm.weight, eps
            )[1]
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
                eagle_kernels.rescore_close(self, scores, feature, ids)
            return ids, scores
        return None, self.compute_logits(feature)

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
        fused = eagle_kernels.fused_weights(self)
        if fused is not None and hidden.dim() == 2 and hidden.dtype == torch.float32:
            top = int(positions.max()) + 1 if len(positions) else 1
            cos, sin = self.rope_full_table(top, positions.device)  # reaching every position
            shape = eagle_kernels.fused_shape(self)
            return self._kernels.eagle_cache_entries(
                fused, shape, hidden.contiguous(), next_tokens, positions, cos, sin
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
        its nodes (inferd.spec.draft_tree); the chains then stop once no deeper draft could be
        among any chain's k likeliest nodes (`SettledChains`), so all three may hold fewer than k
        steps."""
        greedy = not (return_logits or choose)
        assert greedy or not (alternatives or confidences), "alternatives, confidences: greedy only"
        assert not (alternatives and confidences), "alternatives or confidences, not both"
        if greedy and not alternatives and k > 0:
            fused = eagle_kernels.fused_weights(self)
            if fused is not None:
                tokens, seconds, probs = eagle_kernels.draft_fused(
                    self, fused, caches, k, confidences
                )
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
                    ext.paged_attention_short(
                        q[i : i + 1],
                        c.k.unsqueeze(0),
                        c.v.unsqueeze(0),
                        zero,
                        one,
                        torch.tensor([n]),
                        table,
                        attn[i : i + 1],
                        scale,
                    )
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
                others, prob = eagle_kernels.runner_ups(scores, best, self._kernels)
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

    # ---- disk --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `path/model.safetensors` (fp32) and `path/config.json`; returns the directory
        (inferd.spec.eagle_io)."""
        return eagle_io.save_head(self, path)

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
        return eagle_io.load_head(cls, path, target_model, device, dtype, quantize)
