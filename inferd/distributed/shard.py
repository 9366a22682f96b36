"""One tensor-parallel rank's slice of a checkpoint: the sharded config it builds and the HF-named
weights it loads (before `load_weights`, so every family's loader runs unchanged on a shard).

Megatron's split, as vLLM and SGLang make it:
- column-parallel (output rows split): q/k/v by heads, gate/up by intermediate rows, each expert's
  gate/up and the shared expert's likewise; the output needs no communication;
- row-parallel (input columns split): o_proj by the same heads, down_proj by the same rows; each
  rank's output is a partial sum, added across ranks by one all-reduce per layer output;
- vocabulary-parallel: the embedding's and the LM head's rows by token id;
- replicated: norms, the router, a shared expert's gate, and the KV heads when there are fewer of
  them than ranks (rank r then holds KV head r // (tp / kv_heads), the one its query heads read).

Quantized weights are cut in their packed form: rows anywhere, columns only on the format's block
and group boundaries (`QuantizedWeight.columns`). Under `--quantization int8|int4|fp8` a float
weight is quantized whole first and then cut, so each rank holds exactly the rows and scales a
single engine would: TP changes where a weight lives, never its values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from inferd.config import ModelConfig
from inferd.quantization.formats import QuantizedWeight
from inferd.quantization.policy import linear_weight

Weight = torch.Tensor | QuantizedWeight
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GATE_UP = ("gate_proj", "up_proj", "w1", "w3")  # column-parallel MLP parts (Mixtral: w1, w3)
_DOWN = ("down_proj", "w2")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming what does not split `tp` ways (heads, KV heads, vocabulary, MLP rows, an
    architecture whose attention has no head-wise split)."""
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if tp == 1:
        return
    name = f"--tensor-parallel-size {tp}"
    if cfg.is_mla:
        raise ValueError(f"{name}: {cfg.architecture}'s latent attention (MLA) has no tensor-parallel "
                         "split in inferd")  # fmt: skip
    if cfg.architecture == "olmoe":
        raise ValueError(f"{name}: OLMoE normalises q and k over all heads at once, which a head "
                         "split cannot compute locally")  # fmt: skip
    if cfg.num_heads % tp:
        raise ValueError(
            f"{name}: the model's {cfg.num_heads} attention heads do not divide by {tp}"
        )
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"{name}: the model's {kv} KV heads neither divide by {tp} nor divide it "
                         "(to be replicated)")  # fmt: skip
    if cfg.vocab_size % tp:
        raise ValueError(
            f"{name}: the vocabulary of {cfg.vocab_size} tokens does not divide by {tp}"
        )
    for what, size in (("intermediate_size", cfg.intermediate_size),
                       ("moe_intermediate_size", cfg.moe_intermediate_size),
                       ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):  # fmt: skip
        if size % tp:
            raise ValueError(f"{name}: the model's {what} {size} does not divide by {tp}")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's model is built from: its heads, KV heads, MLP rows and vocabulary."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
        intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
    )  # fmt: skip


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, QuantizedWeight):
        return w.rows(torch.arange(start, end))
    return w[start:end].contiguous()


def _columns(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, QuantizedWeight):
        return w.columns(start, end)
    return w[:, start:end].contiguous()


def _cat(parts: list[Weight]) -> Weight:
    if isinstance(parts[0], QuantizedWeight):
        from inferd.quantization.formats import cat_rows

        return cat_rows(parts)
    return torch.cat(parts)


class Sharder:
    """Cuts HF-named weights for rank `rank` of `tp` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, model_cls: type, rank: int, tp: int) -> None:
        check_tensor_parallel(cfg, tp)
        self.cfg, self.cls, self.rank, self.tp = cfg, model_cls, rank, tp
        d = cfg.head_dim
        q_heads = cfg.num_heads // tp
        self.q = (rank * q_heads * d, (rank + 1) * q_heads * d)
        kv = cfg.num_kv_heads
        first_kv = rank * kv // tp if kv >= tp else rank // (tp // kv)
        kv_heads = max(1, kv // tp)
        self.kv = (first_kv * d, (first_kv + kv_heads) * d)
        vocab = cfg.vocab_size // tp
        self.vocab = (rank * vocab, (rank + 1) * vocab)

    def _part(self, size: int) -> tuple[int, int]:
        n = size // self.tp
        return self.rank * n, (self.rank + 1) * n

    def _mlp(self, rest: str, w: Weight) -> Weight | None:
        """An MLP, expert or shared-expert weight cut by its intermediate rows; None: not one."""
        cfg = self.cfg
        *_, proj, _ = rest.split(".")
        if proj not in (*_GATE_UP, "gate_up_proj", *_DOWN):
            return None
        if f"{self.cls.SHARED_EXPERT}." in rest:
            inter = cfg.shared_expert_intermediate_size
        elif "experts." in rest:
            inter = cfg.moe_intermediate_size
        else:
            inter = cfg.intermediate_size
        a, b = self._part(inter)
        if proj in _DOWN:
            return _columns(w, a, b)
        if proj == "gate_up_proj":  # gate rows, then up rows
            return _cat([_rows(w, a, b), _rows(w, inter + a, inter + b)])
        return _rows(w, a, b)

    def _attention(self, proj: str, w: Weight) -> Weight:
        cfg = self.cfg
        if proj == "o_proj":
            return _columns(w, *self.q)
        if proj == "q_proj":
            return _rows(w, *self.q)
        if proj in ("k_proj", "v_proj"):
            return _rows(w, *self.kv)
        # Phi-3's fused q, k, v rows
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return _cat([_rows(w, *self.q), _rows(w, q + self.kv[0], q + self.kv[1]),
                     _rows(w, q + kv + self.kv[0], q + kv + self.kv[1])])  # fmt: skip

    def shard(self, name: str, w: Weight) -> Weight:
        """This rank's part of weight `name` (the whole of a replicated one)."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return _rows(w, *self.vocab)
        m = _LAYER.fullmatch(name)
        if m is None:
            return w
        rest = m.group(2)
        parts = rest.split(".")
        if parts[0] == "self_attn" and parts[1] in (
            "q_proj",
            "k_proj",
            "v_proj",
            "qkv_proj",
            "o_proj",
        ):
            if parts[1] == "o_proj" and parts[2] == "bias":
                raise ValueError(f"{name}: a row-parallel bias is not supported")
            return self._attention(parts[1], w)
        cut = self._mlp(rest, w)
        return w if cut is None else cut


def _unstack_experts(weights: dict[str, Weight], cls: type, cfg: ModelConfig) -> dict[str, Weight]:
    """Stacked expert tensors (transformers' `mlp.experts.gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I]; the GGUF loader's `mlp.experts.{gate,up,down}_proj`, experts' rows one
    after another) → per-expert HF names under the family's MoE module, so that every expert is
    cut (and quantized) as a 2-D linear."""
    out = dict(weights)
    gate_n, up_n, down_n = cls.EXPERT_NAMES

    def expert(key: str, e: int) -> Weight:
        w = weights[key]
        if isinstance(w, QuantizedWeight):
            rows = w.shape[0] // cfg.num_experts
            return w.rows(torch.arange(e * rows, (e + 1) * rows))
        return w[e]

    for name in [n for n in weights if n.endswith("mlp.experts.down_proj")]:
        src = name.removesuffix("mlp.experts.down_proj")
        dst = f"{src}{cls.MOE_MODULE}."
        e_count = cfg.num_experts
        fused = f"{src}mlp.experts.gate_up_proj"
        for e in range(e_count):
            if fused in weights:
                gu = expert(fused, e)
                inter = gu.shape[0] // 2
                out[f"{dst}experts.{e}.{gate_n}.weight"] = _rows(gu, 0, inter)
                out[f"{dst}experts.{e}.{up_n}.weight"] = _rows(gu, inter, 2 * inter)
            else:
                out[f"{dst}experts.{e}.{gate_n}.weight"] = expert(f"{src}mlp.experts.gate_proj", e)
                out[f"{dst}experts.{e}.{up_n}.weight"] = expert(f"{src}mlp.experts.up_proj", e)
            out[f"{dst}experts.{e}.{down_n}.weight"] = expert(name, e)
        for key in (fused, f"{src}mlp.experts.gate_proj", f"{src}mlp.experts.up_proj", name):
            out.pop(key, None)
        if cls.MOE_MODULE != "mlp":  # the router and shared expert move with the experts
            for key in [k for k in out if k.startswith(f"{src}mlp.")]:
                out[f"{dst}{key.removeprefix(f'{src}mlp.')}"] = out.pop(key)
    return out


def _is_linear(name: str, tied: bool) -> bool:
    if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
        return True
    last = name.removesuffix(".weight")
    return name.endswith(".weight") and last.rsplit(".", 1)[-1] in (
        "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_up_proj", *_GATE_UP, *_DOWN)  # fmt: skip


def shard_weights(
    weights: dict[str, Weight],
    cfg: ModelConfig,
    model_cls: type,
    rank: int,
    tp: int,
    quantization: str = "none",
    group_size: int = 32,
) -> dict[str, Weight]:
    """Rank `rank`'s HF-named weights (module docstring)."""
    if tp == 1:
        return weights
    sharder = Sharder(cfg, model_cls, rank, tp)
    weights = _unstack_experts(weights, model_cls, cfg)
    quantize: Callable[[str, Weight], Weight] = lambda name, w: w
    if quantization in ("int8", "int4", "fp8"):
        tied = cfg.tie_word_embeddings

        def quantize(name: str, w: Weight) -> Weight:
            if not _is_linear(name, tied):
                return w
            head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
            return linear_weight([w], quantization, group_size, head)

    return {name: sharder.shard(name, quantize(name, w)) for name, w in weights.items()}
