"""The decoder every family runs (`DecoderForCausalLM`), over a ragged batch with paged KV, each
layer built from its `LayerSpec` (inferd/models/spec.py): norm placement, qk-norm, activation,
RoPE table, window, attention scale and soft-capping. A family is a subclass naming its
checkpoint's tensors and fixing its traits (inferd/models/llama.py, gemma3.py, ...).

The per-layer code calls submodules' `forward` directly and splits with `split_with_sizes`: no
hooks are ever registered here, and `nn.Module.__call__`'s hook checks plus `Tensor.split`'s Python
wrapper are a measurable share of a batch-1 decode step (9 submodule calls and 3 splits a layer).

Kernels are chosen at load, not per call (`select_kernels`, which `build_model` runs): every
layer's attention runs one `AttentionBackend` (inferd/layers/attention.py), its rotary rotation
and activation-mul one function each; linears and norms choose from their weights. A step
whose every query row goes to that backend's short-query kernel (decodes, speculative
verification) runs all layers in one call instead (csrc/decoder_layers.h, from the same
extension), the spec passed along: the same kernels in the same order, so the same bits, without
~25 Python-level calls per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from inferd import envs
from inferd.config import ModelConfig
from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.kv.kv_cache import QuantizedKV
from inferd.layers.attention import (
    KERNEL_CALL_ROWS,
    AttentionBackend,
    AttentionMetadata,
    select_attention_backend,
)
from inferd.layers.linear import Embedding, Linear
from inferd.layers.mlp import MLP, select_act_mul
from inferd.layers.moe import SparseMoE
from inferd.layers.norm import RMSNorm
from inferd.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
from inferd.layers.rotary import RotaryEmbedding, Rotate, rope_parameters, select_rotary
from inferd.lora.slots import LoRASite, LoRASlots
from inferd.models.mla import MLAttention
from inferd.models.spec import ACTIVATIONS, LayerSpec, ModelSpec, uniform_spec
from inferd.quantization import formats, gguf_blocks
from inferd.quantization.formats import QuantizedWeight
from inferd.quantization.policy import linear_weight

# Off: every step runs the Python layer loop (the tests compare the two paths; INFERD_FUSED_DECODE=0
# turns it off in every process of an engine, its tensor-parallel ranks included).
FUSED_DECODE = envs.INFERD_FUSED_DECODE
_LINEAR_KINDS = {"int8": 1, "int4": 2, "fp8": 3}  # decoder::LinearWeights::Kind; 0 is fp32
_TILES_KIND = 4  # int8 / int4 packed at load (formats.pack_tiles)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, D] of the step's positions


def kernel_linear_weights(ext, module: nn.Module):
    """A `Linear` or `QuantizedLinear` as the C++ steps take it (decoder::LinearWeights); an
    `Embedding` or `QuantizedEmbedding` likewise, its table the weight (the C++ looks rows up)."""
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        w = module.qweight
        if w.format in gguf_blocks.FORMATS:  # GGUF's 5- / 6-bit and K-quant blocks
            kind = gguf_blocks.kernel_kind(w)
        else:
            kind = _TILES_KIND if w.layout == "tiles" else _LINEAR_KINDS[w.format]
        bias = getattr(module, "bias", None)
        return ext.LinearWeights(kind, w.data, w.scales, w.mins, bias, w.group, w.streamed)
    return ext.LinearWeights(0, module.weight, None, None, getattr(module, "bias", None), 0)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope_index: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        # q, k and v in one matmul: one pass over the input instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        # qk-norm over each head, or (OLMoE) over the whole q and k projections
        self.qk_norm_all = spec.qk_norm and spec.qk_norm_span == "all"
        q_width, k_width = (self.q_size, self.kv_size) if self.qk_norm_all else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if spec.qk_norm else None
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = spec.attn_scale
        self.window = spec.sliding_window
        self.softcap = spec.attn_softcap
        self.rope_index = rope_index  # which of the model's RoPE tables this layer rotates by
        # Chosen at load (DecoderForCausalLM.select_kernels).
        self.backend: AttentionBackend | None = None
        self.rotate: Rotate | None = None
        # LoRA adapters' batched deltas (inferd/lora/slots.py), set with --enable-lora.
        self.qkv_lora: LoRASite | None = None
        self.o_lora: LoRASite | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        ropes: list[Rope],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora.add(x, qkv)
        cos, sin = ropes[self.rope_index]
        if self.qk_norm_all:
            q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], -1)
            q = self.rotate(self.q_norm.forward(q).view(t, self.n_heads, self.head_dim), cos, sin)
            k = self.rotate(self.k_norm.forward(k).view(t, self.n_kv, self.head_dim), cos, sin)
            return self._attend(q, k, v, kv_cache, meta)
        qk, v = qkv.split_with_sizes([self.q_size + self.kv_size, self.kv_size], -1)
        qk = qk.view(t, self.n_heads + self.n_kv, self.head_dim)
        if self.q_norm is None:
            # q and k heads rotate together: one set of elementwise ops instead of two.
            q, k = self.rotate(qk, cos, sin).split_with_sizes([self.n_heads, self.n_kv], 1)
        else:
            q, k = qk.split_with_sizes([self.n_heads, self.n_kv], 1)
            q = self.rotate(self.q_norm.forward(q), cos, sin)
            k = self.rotate(self.k_norm.forward(k), cos, sin)
        return self._attend(q, k, v, kv_cache, meta)

    def _attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        v = v.view(t, self.n_kv, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window,
                                 self.softcap)  # fmt: skip
        o = o.reshape(t, self.q_size)
        if self.o_lora is not None:
            return self.o_lora.add(o, self.o_proj.forward(o))
        return self.o_proj.forward(o)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); "sandwich" norms the attention and MLP outputs
    too before their adds (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope_index: int) -> None:
        super().__init__()
        sandwich = spec.norm == "sandwich"
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = (MLAttention if spec.mla else Attention)(cfg, spec, rope_index)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else None
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if spec.moe is None else SparseMoE(cfg.hidden_size, spec.moe)
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else None
        # Under tensor parallelism (inferd/distributed): the attention and MLP outputs are this
        # rank's partial sums, added across ranks by this all-reduce before anything reads them.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x, ropes, kv_cache, meta) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(x), ropes, kv_cache, meta)
        if self.reduce is not None:
            h = self.reduce(h)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm.forward(h)
        x = x + h
        h = self.mlp.forward(self.pre_mlp_norm.forward(x))
        if self.reduce is not None:
            h = self.reduce(h)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm.forward(h)
        return x + h


class DecoderForCausalLM(nn.Module):
    """A causal LM (inferd/models/interface.py's `CausalLM`). Subclasses, one per family, set the
    checkpoint's names below and override `spec_for` for their traits."""

    # HF checkpoint names (under model.layers.{i}.) of each layer norm; None: the family has none.
    NORM_NAMES: ClassVar[dict[str, str | None]] = {
        "input_layernorm": "input_layernorm",
        "post_attn_norm": None,
        "pre_mlp_norm": "post_attention_layernorm",
        "post_mlp_norm": None,
    }
    FUSED_QKV: ClassVar[bool] = False  # the checkpoint holds self_attn.qkv_proj (Phi-3)
    FUSED_GATE_UP: ClassVar[bool] = False  # the checkpoint holds mlp.gate_up_proj (Phi-3)
    # A mixture's checkpoint names under model.layers.{i}.: its module, and each expert's gate,
    # up and down projections (under {MOE_MODULE}.experts.{e}.).
    MOE_MODULE: ClassVar[str] = "mlp"
    EXPERT_NAMES: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    SHARED_EXPERT: ClassVar[str] = "shared_expert"  # (under MOE_MODULE)

    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        """The family's per-layer spec for this config."""
        return uniform_spec(cfg)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.spec = spec = self.spec_for(cfg)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, s, spec.rope_index(i)) for i, s in enumerate(spec.layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # One per distinct RoPE of the spec, set by `set_rotary` once the weights (and GGUF's
        # rope_freqs, if any) are known.
        self.rotaries: list[RotaryEmbedding] = []
        self.attention_backend: AttentionBackend | None = None  # select_kernels
        self._fused_layers: list | None = None  # the layers' weights for decode_layers, built once
        self._fused_specs: list | None = None
        self._tiles = False  # some weights packed into tiles: the fused step needs int8 activations
        # Layers whose output (the residual stream, before the final norm) `forward` keeps in
        # `captured`, ascending: the extra features a learned draft head reads (EAGLE-3).
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []
        self._embed_scale: float | None = spec.embed_scale
        # Whether this model's decode steps may run the fused C++ step (and FUSED_DECODE).
        self.fused_decode = True
        # With --enable-lora (set_lora): the adapters' slots, whose delta both layer paths add.
        self.lora_slots: LoRASlots | None = None
        self.requires_grad_(False)

    def set_rotary(self, max_positions: int, rope_freq_factors: torch.Tensor | None,
                   device: torch.device) -> None:  # fmt: skip
        """fp32 cos/sin tables whatever the weight dtype, for positions [0, max_positions); GGUF's
        rope_freqs (llama3 scaling precomputed) go with the config's own RoPE."""
        cfg = self.config
        self.rotaries = []
        for rope in self.spec.ropes():
            own = rope.theta == cfg.rope_theta and rope.scaling_dict() == cfg.rope_scaling
            factors = rope_freq_factors if own else None
            inv_freq, attention = rope_parameters(cfg.head_dim, rope.theta, rope.scaling_dict(), factors,
                                                  max_positions)  # fmt: skip
            self.rotaries.append(
                RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, attention).to(device)
            )

    def select_kernels(self, device: torch.device, dtype: torch.dtype,
                       attention: str | None = None) -> None:  # fmt: skip
        """Choose, once, the kernels of the ops the layers call by function: attention (the
        backend `attention` names, else the preferred one for `device` and `dtype`), the rotary
        rotation and activation-mul. (Linears and norms choose theirs from their weights.)"""
        backend = select_attention_backend(device, dtype, self.config.kv_layout()[2], attention)
        self.attention_backend = backend
        rotate = select_rotary(device, dtype)
        for layer, spec in zip(self.layers, self.spec.layers):
            layer.self_attn.backend = backend
            layer.self_attn.rotate = rotate
            layer.mlp.set_act_mul(select_act_mul(spec.activation, device, dtype))
        ext = cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
        if ext is not None:
            self.select_moe_kernels(ext)
        for layer in self.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.dense = ext

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self._embed_scale is not None:  # HF multiplies by the scale as a tensor of x's dtype
            x = x * torch.tensor(self._embed_scale, dtype=x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed(input_ids)
        ropes = [rotary(positions) for rotary in self.rotaries]
        if FUSED_DECODE and self.fused_decode and self._fused_step_takes(x, kv_caches, meta):
            captured = None
            if self.capture_layers:  # rows the C++ step copies out as it passes those layers
                captured = x.new_empty((len(self.capture_layers), *x.shape))
                self.captured = list(captured.unbind(0))
            ext = meta.kernel_group.kernel
            return self.norm(self._decode_layers(ext, x, ropes, kv_caches, meta, captured))
        captured = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer.forward(x, ropes, kv, meta.for_layer(i))
            if i in self.capture_layers:
                captured.append(x)
        self.captured = captured
        return self.norm(x)

    def _fused_step_takes(self, x: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Whether `decode_layers` runs this step: every row in the kernel group (whose C++
        extension holds it), fp32 rows on the CPU, a cache it reads (plain, 2-byte or quantized), int8 activations
        where weights are packed into tiles (tiles have no fp32-activation kernel), and no more
        rows than one attention kernel call takes (the C++ step attends all its rows in one)."""
        kg = meta.kernel_group
        return (kg is not None and meta.group is None and not meta.prefills
                and x.dtype == torch.float32 and x.is_cpu
                and type(kv_caches[0][0]) in (torch.Tensor, QuantizedKV)
                and (not self._tiles or formats.int8_activations_default(kg.kernel))
                and x.shape[0] <= KERNEL_CALL_ROWS and not self.config.is_mla)  # fmt: skip

    def _fused_weights(self, ext) -> tuple[list, list]:
        """The layers' weights and specs as decoder_layers takes them (built once)."""
        if self._fused_layers is None:
            linear = functools.partial(kernel_linear_weights, ext)

            def weight(norm: RMSNorm | None) -> torch.Tensor | None:
                return None if norm is None else norm.weight

            none = ext.LinearWeights(0, torch.empty(0), None, None, None, 0)

            def lora(l: DecoderLayer) -> list | None:  # the slots of qkv, o, gate_up and down
                attn, mlp = l.self_attn, l.mlp
                if attn.qkv_lora is None:  # no --enable-lora (a mixture's MLP never has slots)
                    return None
                sites = (attn.qkv_lora, attn.o_lora, mlp.gate_up_lora, mlp.down_lora)
                return [ext.LoRAWeights(site.a, site.b, site.parts) for site in sites]

            def mlp(l: DecoderLayer) -> dict:
                if isinstance(l.mlp, SparseMoE):  # (its MoeWeights: the layer's kernel call's own)
                    return {"gate_up": none, "down": none, "moe": l.mlp.kernel[1]}
                return {"gate_up": linear(l.mlp.gate_up_proj), "down": linear(l.mlp.down_proj)}

            self.select_moe_kernels(ext)
            self._fused_layers = [
                ext.LayerWeights(
                    l.input_layernorm.weight, l.pre_mlp_norm.weight,
                    qkv=linear(l.self_attn.qkv_proj), o=linear(l.self_attn.o_proj),
                    q_norm=weight(l.self_attn.q_norm), k_norm=weight(l.self_attn.k_norm),
                    post_attn_norm=weight(l.post_attn_norm), post_mlp_norm=weight(l.post_mlp_norm),
                    lora=lora(l), **mlp(l),
                )
                for l in self.layers
            ]  # fmt: skip
            self._fused_specs = [
                ext.DecoderLayerSpec(l.self_attn.rope_index, s.sliding_window or 0, s.attn_scale,
                                     s.attn_softcap or 0.0, ACTIVATIONS.index(s.activation),
                                     qk_norm_all=l.self_attn.qk_norm_all)
                for l, s in zip(self.layers, self.spec.layers)
            ]  # fmt: skip
        return self._fused_layers, self._fused_specs

    def select_moe_kernels(self, ext) -> None:
        """Mixture layers run moe_layer.h (through `ext`, the step's extension) from now on:
        weights as they are stored now (call again after a repack)."""
        int8 = formats.int8_activations_default(ext)
        for layer, spec in zip(self.layers, self.spec.layers):
            if isinstance(layer.mlp, SparseMoE):
                weights = layer.mlp.kernel_weights(ext, kernel_linear_weights, ACTIVATIONS.index(spec.activation))
                layer.mlp.kernel = (ext, weights, int8)

    def _decode_layers(self, ext, x, ropes, kv_caches, meta: AttentionMetadata,
                       captured: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Every layer in one C++ call (csrc/decoder_layers.h) for a kernel-group-only step; the
        outputs of `capture_layers` copied into `captured` when given."""
        layers, specs = self._fused_weights(ext)
        cfg, kg = self.config, meta.kernel_group
        shape = ext.DecoderShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                 cfg.rms_norm_eps, self.spec.layers[0].attn_scale,
                                 formats.int8_activations_default(ext))  # fmt: skip
        first = kv_caches[0][0]
        if isinstance(first, QuantizedKV):  # codes and scales: quantized in C++ as kv_cache.py does
            quant = ext.QuantizedCaches([kv[0].scale for kv in kv_caches], [kv[1].scale for kv in kv_caches],
                                        first.fmt.kernel_code, first.fmt.qmax)  # fmt: skip
            k_caches, v_caches = [kv[0].data for kv in kv_caches], [kv[1].data for kv in kv_caches]
        else:
            quant = ext.QuantizedCaches([], [], 0, 0.0)
            k_caches, v_caches = [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]
        groups = meta.groups()  # KV cache groups: each its own slots and block tables
        return ext.decode_layers(
            x, layers, specs, k_caches, v_caches, [r[0] for r in ropes], [r[1] for r in ropes],
            [m.slot_mapping for m in groups], kg.row_start, kg.q_lens, kg.ctx_lens,
            [m.kernel_group.block_tables for m in groups], meta.layer_groups(len(layers)), shape, quant,
            meta.mirror_rows, [m.mirror_slots for m in groups] if meta.mirror_rows is not None else [],
            list(self.capture_layers) if captured is not None else [], captured,
            self.layers[0].reduce, self.lora_masks(),
        )  # fmt: skip

    def lora_masks(self) -> dict[int, torch.Tensor]:
        """The step's LoRA masks by part count (LoRASlots.masks); empty: no adapted row."""
        slots = self.lora_slots
        return {} if slots is None or slots.masks is None else slots.masks

    def set_lora(self, slots: LoRASlots) -> None:
        """Adapters' slots (--enable-lora, inferd/lora), every layer's linears already holding
        their sites: steps with adapted rows add their delta, on either layer path."""
        self.lora_slots = slots
        self._fused_layers = None  # the fused step's weights take the sites in

    def weights_repacked(self) -> None:
        """`pack_quantized_weights` replaced weights: rebuild the fused step's view of them."""
        self._fused_layers = None
        self._tiles = True
        moe = next((l.mlp for l in self.layers if isinstance(l.mlp, SparseMoE) and l.mlp.kernel), None)
        if moe is not None:
            self.select_moe_kernels(moe.kernel[0])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the rows that sample: [B, vocab]."""
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _load_moe(self, src: str, dst: str, moe, take, put, put_linear) -> None:
        """One mixture layer's router (kept fp32: routing decides which weights run at all),
        experts and shared expert, from per-expert tensors (`{MOE_MODULE}.experts.{e}.*`) or
        stacked ones under `mlp.experts.` (transformers' `gate_up_proj` [E, 2I, H] and
        `down_proj`; or the GGUF loader's `gate_proj` / `up_proj` / `down_proj`, packed weights
        with the experts' rows one after another)."""
        stacked = f"{src}mlp.experts.down_proj" in self._weight_names
        mod = f"{src}mlp." if stacked else f"{src}{self.MOE_MODULE}."
        router = take(f"{mod}gate.weight")
        put(f"{dst}gate.weight", router if isinstance(router, torch.Tensor) else linear_weight([router], "none"))
        gate, up, down = self.EXPERT_NAMES

        def expert(name: str, e: int):
            w = take(f"{mod}experts.{name}")
            if isinstance(w, QuantizedWeight):
                rows = w.shape[0] // moe.num_experts
                return w.rows(torch.arange(e * rows, (e + 1) * rows))
            return w[e]

        for e in range(moe.num_experts):
            if not stacked:
                gate_up = [take(f"{mod}experts.{e}.{gate}.weight"), take(f"{mod}experts.{e}.{up}.weight")]
                down_w = take(f"{mod}experts.{e}.{down}.weight")
            elif f"{mod}experts.gate_up_proj" in self._weight_names:
                gate_up, down_w = [expert("gate_up_proj", e)], expert("down_proj", e)
            else:
                gate_up = [expert("gate_proj", e), expert("up_proj", e)]
                down_w = expert("down_proj", e)
            put_linear(f"{dst}experts.{e}.gate_up_proj", gate_up)
            put_linear(f"{dst}experts.{e}.down_proj", [down_w])
        if moe.shared_intermediate:
            shared = f"{mod}{self.SHARED_EXPERT}."
            put_linear(f"{dst}shared_expert.gate_up_proj",
                       [take(f"{shared}gate_proj.weight"), take(f"{shared}up_proj.weight")])  # fmt: skip
            put_linear(f"{dst}shared_expert.down_proj", [take(f"{shared}down_proj.weight")])
            if moe.shared_gated:
                put(f"{dst}shared_expert_gate.weight", take(f"{mod}shared_expert_gate.weight").reshape(1, -1))

    def load_weights(
        self,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        quantization: str = "none",
        group_size: int = 32,
    ) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up as this module stores them; linear
        layers whose weight `--quantization` keeps quantized become `QuantizedLinear`s."""
        self._fused_layers = None
        self._tiles = False
        own = dict(self.named_parameters(remove_duplicate=False))
        self._weight_names = weights.keys()
        used: set[str] = set()
        offset = self.spec.norm_offset

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} missing from the checkpoint")
            used.add(name)
            return weights[name]

        def put(name: str, value: torch.Tensor) -> None:
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} "
                                 f"!= model shape {tuple(param.shape)}")  # fmt: skip
            param.copy_(
                value
            )  # (not through .data: the write must bump the version a packed copy checks)

        def put_norm(name: str, value: torch.Tensor) -> None:
            put(name, value + offset if offset else value)

        device, dtype = self.norm.weight.device, self.norm.weight.dtype

        def put_linear(name: str, parts: list, head: bool = False) -> QuantizedWeight | None:
            w = linear_weight(parts, quantization, group_size, head)
            if not isinstance(w, QuantizedWeight):
                put(f"{name}.weight", w)
                return None
            parent, _, attr = name.rpartition(".")
            module = self.get_submodule(parent) if parent else self
            w = w.to(device)
            setattr(module, attr, QuantizedLinear(w, getattr(module, attr).bias))
            return w

        embed = take("model.embed_tokens.weight")
        if self.config.tie_word_embeddings:
            head = linear_weight([embed], quantization, group_size, head=True)
            if isinstance(head, QuantizedWeight):  # the embedding reads the head's rows
                head = head.to(device)
                self.lm_head = QuantizedLinear(head)
                self.embed_tokens = QuantizedEmbedding(head, dtype)
            else:
                put("embed_tokens.weight", head)
                self.lm_head.weight = self.embed_tokens.weight  # to_empty() may have split it
        else:
            if isinstance(embed, QuantizedWeight) and quantization != "none":
                self.embed_tokens = QuantizedEmbedding(embed.to(device), dtype)
            else:
                put("embed_tokens.weight", embed if isinstance(embed, torch.Tensor)
                    else linear_weight([embed], "none"))  # fmt: skip
            put_linear("lm_head", [take("lm_head.weight")], head=True)
        put_norm("norm.weight", take("model.norm.weight"))
        for i, spec in enumerate(self.spec.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm, name in self.NORM_NAMES.items():
                if name is not None and getattr(self.layers[i], norm) is not None:
                    put_norm(f"{dst}{norm}.weight", take(f"{src}{name}.weight"))
            attn = f"{src}self_attn."
            if spec.mla:
                self.layers[i].self_attn.load(attn, f"{dst}self_attn.", take, put, put_norm, put_linear)
            else:
                self._load_attention(attn, f"{dst}self_attn.", spec, take, put, put_norm, put_linear)
            if spec.moe is not None:
                self._load_moe(src, f"{dst}mlp.", spec.moe, take, put, put_linear)
                continue
            mlp = f"{src}mlp."
            if self.FUSED_GATE_UP:
                gate_up = [take(f"{mlp}gate_up_proj.weight")]
            else:
                gate_up = [take(f"{mlp}gate_proj.weight"), take(f"{mlp}up_proj.weight")]
            put_linear(f"{dst}mlp.gate_up_proj", gate_up)
            put_linear(f"{dst}mlp.down_proj", [take(f"{mlp}down_proj.weight")])
        ignored = {"rope_freq_factors"} | {k for k in weights if k.endswith("rotary_emb.inv_freq")}
        unknown = set(weights) - used - ignored
        if self.config.tie_word_embeddings:
            unknown.discard("lm_head.weight")
        if unknown:
            raise ValueError(
                f"checkpoint has weights this model does not use: {sorted(unknown)[:5]}"
            )

    def _load_attention(self, attn: str, dst: str, spec: LayerSpec, take, put, put_norm, put_linear) -> None:
        """One layer's q/k/v (fused into one matmul), their biases and norms, and o."""
        if self.FUSED_QKV:
            qkv = [take(f"{attn}qkv_proj.weight")]
        else:
            qkv = [take(f"{attn}{p}_proj.weight") for p in "qkv"]
        put_linear(f"{dst}qkv_proj", qkv)
        if spec.qkv_bias:
            bias = (
                [take(f"{attn}qkv_proj.bias")]
                if self.FUSED_QKV
                else [take(f"{attn}{p}_proj.bias") for p in "qkv"]
            )
            put(f"{dst}qkv_proj.bias", torch.cat(bias))
        if spec.qk_norm:
            put_norm(f"{dst}q_norm.weight", take(f"{attn}q_norm.weight"))
            put_norm(f"{dst}k_norm.weight", take(f"{attn}k_norm.weight"))
        put_linear(f"{dst}o_proj", [take(f"{attn}o_proj.weight")])
