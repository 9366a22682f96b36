"""What each decoder layer computes, as data: the per-layer spec that the Python layers and the
fused C++ decode step (csrc/decoder_layers.h) both read.

A family's differences from Llama are values here, not forks of the engine: where the norms sit
("pre", or Gemma 2/3's "sandwich": pre and post norms around both attention and MLP), RMSNorm of
each query / key head (Qwen3, Gemma 3), the MLP's activation, each layer's RoPE (Gemma 3: base 10k
on local layers, 1M on global ones), sliding window, attention scale and logit soft-capping, plus
the model-wide embedding scale, final soft-capping and head tying.

`uniform_spec` builds a spec from a `ModelConfig` for the traits a family fixes (norm placement,
qk-norm, embedding scale); everything the checkpoint states (windows per layer, rope bases,
soft-capping, scale) comes from the config.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from inferd.config import ModelConfig

NORM_PLACEMENTS = ("pre", "sandwich")
# The MLP's activation by HF `hidden_act` name → the spec's name; the fused step's code is the
# index in ACTIVATIONS.
ACTIVATIONS = ("silu", "gelu_tanh")
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_tanh": "gelu_tanh"}  # fmt: skip


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE table: base and HF-style scaling (items sorted, lists as tuples: hashable, so
    layers that share a table share one)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def of(theta: float, scaling: dict[str, Any] | None) -> RopeSpec:
        return RopeSpec(float(theta), _frozen(scaling) if scaling else ())

    def scaling_dict(self) -> dict[str, Any] | None:
        return {k: _thawed(v) for k, v in self.scaling} or None

    @property
    def kind(self) -> str:
        d = self.scaling_dict() or {}
        return str(d.get("rope_type") or d.get("type") or "default")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts MLP: softmax over the router's logits (fp32), the `top_k` largest kept
    (renormalised to sum 1 where `renormalize`), each chosen expert's SwiGLU-style MLP weighted by
    its probability; plus, where `shared_intermediate`, a shared expert whose output a sigmoid
    gate scales (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate: int
    renormalize: bool
    shared_intermediate: int = 0

    @staticmethod
    def of(cfg: ModelConfig) -> MoeSpec:
        return MoeSpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                       cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)  # fmt: skip


QK_NORM_SPANS = ("head", "all")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    rope: RopeSpec
    attn_scale: float  # multiplies q·k (HF: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5)
    # Keys a query sees, itself included: positions (p - window, p]. None: every earlier key.
    sliding_window: int | None = None
    attn_softcap: float | None = None  # scores → cap · tanh(scores / cap) before the softmax
    norm: str = "pre"  # NORM_PLACEMENTS
    qk_norm: bool = False  # RMSNorm of queries and keys before RoPE
    # "head": over each head (Qwen3, Gemma 3); "all": over the whole q and k projections (OLMoE)
    qk_norm_span: str = "head"
    activation: str = "silu"  # ACTIVATIONS
    qkv_bias: bool = False
    moe: MoeSpec | None = None  # None: a dense MLP

    def __post_init__(self) -> None:
        if self.norm not in NORM_PLACEMENTS:
            raise ValueError(
                f"unknown norm placement {self.norm!r} (known: {', '.join(NORM_PLACEMENTS)})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r} (known: {', '.join(ACTIVATIONS)})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.sliding_window}")
        if self.qk_norm_span not in QK_NORM_SPANS:
            raise ValueError(f"unknown qk-norm span {self.qk_norm_span!r} (known: {', '.join(QK_NORM_SPANS)})")
        if self.attn_softcap is not None and not self.attn_softcap > 0:
            raise ValueError(f"attention soft-capping must be > 0, got {self.attn_softcap}")

    @property
    def is_local(self) -> bool:
        return self.sliding_window is not None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    layers: tuple[LayerSpec, ...]
    tied_head: bool
    embed_scale: float | None = None  # the embedding's rows times this (Gemma: sqrt(hidden))
    final_softcap: float | None = None  # logits → cap · tanh(logits / cap)
    # Added to every RMSNorm weight at load: Gemma's checkpoints store w for a norm that scales by
    # (1 + w). (llama.cpp's converter adds the 1 when it writes a GGUF; the GGUF loader takes it
    # off again, so weights always arrive as the HF checkpoint has them.)
    norm_offset: float = 0.0

    def ropes(self) -> tuple[RopeSpec, ...]:
        """The distinct RoPE tables, in order of first use."""
        return tuple(dict.fromkeys(layer.rope for layer in self.layers))

    def rope_index(self, layer: int) -> int:
        return self.ropes().index(self.layers[layer].rope)

    def summary(self) -> str:
        """e.g. '18 layers: 15 local window 512, 3 global'."""
        n = len(self.layers)
        windows = Counter(layer.sliding_window for layer in self.layers if layer.is_local)
        if not windows:
            return f"{n} layers: all global"
        parts = [f"{c} local window {w}" for w, c in sorted(windows.items())]
        n_global = sum(1 for layer in self.layers if not layer.is_local)
        if n_global:
            parts.append(f"{n_global} global")
        return f"{n} layers: {', '.join(parts)}"

    def traits(self) -> str:
        """The layers' other traits in one line, e.g. 'sandwich norms, qk-norm, gelu_tanh'."""
        first = self.layers[0]
        out = [f"{first.norm} norms" if first.norm != "pre" else "pre-norm"]
        if first.qk_norm:
            out.append("qk-norm" if first.qk_norm_span == "head" else "qk-norm over all heads")
        out.append(first.activation)
        if first.qkv_bias:
            out.append("qkv bias")
        moe = [layer.moe for layer in self.layers if layer.moe is not None]
        if moe:
            m = moe[0]
            where = "" if len(moe) == len(self.layers) else f" in {len(moe)} of {len(self.layers)} layers"
            shared = f" + a shared expert of {m.shared_intermediate}" if m.shared_intermediate else ""
            out.append(f"MoE top-{m.top_k} of {m.num_experts} experts of {m.intermediate}{shared}{where}")
        if first.attn_softcap:
            out.append(f"attention softcap {first.attn_softcap:g}")
        if self.final_softcap:
            out.append(f"final softcap {self.final_softcap:g}")
        if self.embed_scale:
            out.append(f"embedding x {self.embed_scale:.4g}")
        ropes = self.ropes()
        out.append("rope " + " / ".join(f"{r.theta:g}" + (f" {r.kind}" if r.kind != "default" else "")
                                        for r in ropes))  # fmt: skip
        return ", ".join(out)

    def kv_tokens_held(self, layer: int, context: int) -> int:
        """Tokens of a `context`-token sequence whose K/V layer `layer` still reads."""
        w = self.layers[layer].sliding_window
        return context if w is None else min(context, w)


def activation_of(hidden_act: str) -> str:
    act = HF_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise ValueError(
            f"unsupported activation {hidden_act!r} (supported: {', '.join(HF_ACTIVATIONS)})"
        )
    return act


def uniform_spec(
    cfg: ModelConfig,
    *,
    norm: str = "pre",
    qk_norm: bool = False,
    qk_norm_span: str = "head",
    embed_scale: bool = False,
    norm_offset: float = 0.0,
) -> ModelSpec:
    """Every layer alike but for what the config varies per layer: the window (`layer_types`) and
    with it the RoPE base (`rope_local_theta` on local layers, where given)."""
    act = activation_of(cfg.hidden_act)
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    global_rope = RopeSpec.of(cfg.rope_theta, cfg.rope_scaling)
    local_rope = global_rope
    if cfg.rope_local_theta is not None:
        local_rope = RopeSpec.of(cfg.rope_local_theta, None)
    layers = []
    moe = MoeSpec.of(cfg) if cfg.num_experts else None
    for i, kind in enumerate(cfg.layer_kinds()):
        local = kind == "sliding_attention"
        layers.append(LayerSpec(
            rope=local_rope if local else global_rope,
            attn_scale=scale,
            sliding_window=cfg.sliding_window if local else None,
            attn_softcap=cfg.attn_logit_softcapping,
            norm=norm,
            qk_norm=qk_norm,
            qk_norm_span=qk_norm_span,
            activation=act,
            qkv_bias=cfg.attention_bias,
            moe=moe if cfg.is_moe_layer(i) else None,
        ))  # fmt: skip
    return ModelSpec(
        layers=tuple(layers),
        tied_head=cfg.tie_word_embeddings,
        embed_scale=math.sqrt(cfg.hidden_size) if embed_scale else None,
        final_softcap=cfg.final_logit_softcapping,
        norm_offset=norm_offset,
    )
