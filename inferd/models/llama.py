"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a ragged batch with paged KV.

The per-layer code calls submodules' `forward` directly and splits with `split_with_sizes`: no
hooks are ever registered here, and `nn.Module.__call__`'s hook checks plus `Tensor.split`'s Python
wrapper are a measurable share of a batch-1 decode step (9 submodule calls and 3 splits a layer).

Kernels are chosen at load, not per call (`select_kernels`, which `build_model` runs): every
layer's attention runs one `AttentionBackend` (inferd/layers/attention.py), its rotary rotation
and silu-mul one function each; linears and norms choose from their weights. A step
whose every query row goes to that backend's short-query kernel (decodes, speculative
verification) runs all layers in one call instead (csrc/decoder_layers.h, from the same
extension): the same kernels in the same order, so the same bits, without ~25 Python-level calls
per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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
from inferd.layers.norm import RMSNorm
from inferd.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
from inferd.layers.rotary import RotaryEmbedding, Rotate, rope_inv_freq, select_rotary
from inferd.quantization import formats, gguf_blocks
from inferd.quantization.formats import QuantizedWeight
from inferd.quantization.policy import linear_weight

# Off: every step runs the Python layer loop (the tests compare the two paths).
FUSED_DECODE = True
_LINEAR_KINDS = {"int8": 1, "int4": 2, "fp8": 3}  # decoder::LinearWeights::Kind; 0 is fp32
_TILES_KIND = 4  # int8 / int4 packed at load (formats.pack_tiles)


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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        # q, k and v in one matmul: one pass over the input instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)  # fmt: skip
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        # Chosen at load (LlamaForCausalLM.select_kernels).
        self.backend: AttentionBackend | None = None
        self.rotate: Rotate | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qk, v = qkv.split_with_sizes([self.q_size + self.kv_size, self.kv_size], -1)
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = self.rotate(qk.view(t, self.n_heads + self.n_kv, self.head_dim), *rope)
        q, k = qk.split_with_sizes([self.n_heads, self.n_kv], 1)
        v = v.view(t, self.n_kv, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj.forward(o.reshape(t, self.q_size))


SiluMul = Callable[[torch.Tensor], torch.Tensor]


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate/up side by side [T, 2I] → [T, I], in PyTorch ops."""
    gate, up = gu.split_with_sizes([gu.shape[-1] // 2] * 2, -1)
    return F.silu(gate).mul_(up)  # silu's output is fresh: in place


def select_silu_mul(device: torch.device, dtype: torch.dtype) -> SiluMul:
    """`silu_mul_torch`'s op for a model of `dtype` on `device`: for fp32 on the CPU with the C++
    kernels one loop (csrc/layer_ops.h), as the fused decode step runs it."""
    ext = cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    return ext.silu_mul if ext is not None else silu_mul_torch


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)
        self.silu_mul: SiluMul | None = None  # select_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.silu_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, kv_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set by `set_rotary` once the weights (and GGUF's rope_freqs, if any) are known.
        self.rotary: RotaryEmbedding | None = None
        self.attention_backend: AttentionBackend | None = None  # select_kernels
        self._fused_layers: list | None = None  # the layers' weights for decode_layers, built once
        self._tiles = False  # some weights packed into tiles: the fused step needs int8 activations
        self._fused_rows: int | None = None  # _fused_max_rows, once known
        # Layers whose output (the residual stream, before the final norm) `forward` keeps in
        # `captured`, ascending: the extra features a learned draft head reads (EAGLE-3).
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []
        self.requires_grad_(False)

    def set_rotary(self, max_positions: int, rope_freq_factors: torch.Tensor | None,
                   device: torch.device) -> None:  # fmt: skip
        """fp32 cos/sin tables whatever the weight dtype, for positions [0, max_positions)."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq).to(device)

    def select_kernels(self, device: torch.device, dtype: torch.dtype,
                       attention: str | None = None) -> None:  # fmt: skip
        """Choose, once, the kernels of the ops the layers call by function: attention (the
        backend `attention` names, else the preferred one for `device` and `dtype`), the rotary
        rotation and silu-mul. (Linears and norms choose theirs from their weights.)"""
        backend = select_attention_backend(device, dtype, self.config.head_dim, attention)
        self.attention_backend = backend
        rotate, silu_mul = select_rotary(device, dtype), select_silu_mul(device, dtype)
        for layer in self.layers:
            layer.self_attn.backend = backend
            layer.self_attn.rotate = rotate
            layer.mlp.silu_mul = silu_mul

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        if FUSED_DECODE and self._fused_step_takes(x, kv_caches, meta):
            captured = None
            if self.capture_layers:  # rows the C++ step copies out as it passes those layers
                captured = x.new_empty((len(self.capture_layers), *x.shape))
                self.captured = list(captured.unbind(0))
            ext = meta.kernel_group.kernel
            return self.norm(self._decode_layers(ext, x, rope, kv_caches, meta, captured))
        captured = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer.forward(x, rope, kv, meta)
            if i in self.capture_layers:
                captured.append(x)
        self.captured = captured
        return self.norm(x)

    def _fused_step_takes(self, x: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Whether `decode_layers` runs this step: every row in the kernel group (whose extension
        holds it), fp32 rows, a cache it reads (plain, 2-byte or quantized), int8 activations
        where weights are packed into tiles (tiles have no fp32-activation kernel), and no more
        rows than `_fused_max_rows`."""
        kg = meta.kernel_group
        return (kg is not None and meta.group is None and not meta.prefills
                and x.dtype == torch.float32
                and type(kv_caches[0][0]) in (torch.Tensor, QuantizedKV)
                and (not self._tiles or formats.int8_activations_default(kg.kernel))
                and x.shape[0] <= self._fused_max_rows(kg.kernel))  # fmt: skip

    def _fused_max_rows(self, ext) -> int:
        """Rows a fused step may have. Its fp32 matmuls take at::linear above
        `dense_gemm_max_rows` (MKL's sgemm, which runs AMD CPUs on a generic path), where the
        Python layers use oneDNN's packed weights, which are faster there (and round
        differently); such steps take the layer loop. Quantized layers keep their own kernels at
        any row count, and stay fused."""
        if self._fused_rows is None:
            dense = any(
                isinstance(m, Linear)
                for layer in self.layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          layer.mlp.gate_up_proj, layer.mlp.down_proj)
            )  # fmt: skip
            # The C++ step attends all its rows in one kernel call: as many as one call takes.
            self._fused_rows = ext.dense_gemm_max_rows if dense else KERNEL_CALL_ROWS
        return self._fused_rows

    def _decode_layers(self, ext, x, rope, kv_caches, meta: AttentionMetadata,
                       captured: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Every layer in one C++ call (csrc/decoder_layers.h) for a kernel-group-only step; the
        outputs of `capture_layers` copied into `captured` when given."""
        if self._fused_layers is None:
            linear = functools.partial(kernel_linear_weights, ext)
            self._fused_layers = [
                ext.LayerWeights(
                    l.input_layernorm.weight, l.post_attention_layernorm.weight,
                    *map(linear, (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj,
                                  l.mlp.down_proj)),
                )
                for l in self.layers
            ]  # fmt: skip
        cfg, attn, kg = self.config, self.layers[0].self_attn, meta.kernel_group
        shape = ext.DecoderShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                 cfg.rms_norm_eps, attn.scale, formats.int8_activations_default(ext))  # fmt: skip
        first = kv_caches[0][0]
        if isinstance(first, QuantizedKV):  # codes and scales: quantized in C++ as kv_cache.py does
            quant = ext.QuantizedCaches([kv[0].scale for kv in kv_caches], [kv[1].scale for kv in kv_caches],
                                        first.fmt.kernel_code, first.fmt.qmax)  # fmt: skip
            k_caches, v_caches = [kv[0].data for kv in kv_caches], [kv[1].data for kv in kv_caches]
        else:
            quant = ext.QuantizedCaches([], [], 0, 0.0)
            k_caches, v_caches = [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]
        return ext.decode_layers(
            x, self._fused_layers, k_caches, v_caches, rope[0], rope[1], meta.slot_mapping,
            kg.row_start, kg.q_lens, kg.ctx_lens, kg.block_tables, shape, quant,
            meta.mirror_rows, meta.mirror_slots, list(self.capture_layers) if captured is not None else [],
            captured,
        )  # fmt: skip

    def weights_repacked(self) -> None:
        """`pack_quantized_weights` replaced weights: rebuild the fused step's view of them."""
        self._fused_layers = None
        self._fused_rows = None
        self._tiles = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the rows that sample: [B, vocab]."""
        return self.lm_head(hidden).float()

    def load_weights(
        self,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        quantization: str = "none",
        group_size: int = 32,
    ) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up as this module stores them; linear
        layers whose weight `--quantization` keeps quantized become `QuantizedLinear`s."""
        self._fused_layers = None
        self._fused_rows = None
        self._tiles = False
        own = dict(self.named_parameters(remove_duplicate=False))
        used: set[str] = set()

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
            param.copy_(value)  # (not through .data: the write must bump the version a packed copy checks)

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
        put("norm.weight", take("model.norm.weight"))
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
            attn = f"{src}self_attn."
            qkv = [take(f"{attn}{p}_proj.weight") for p in "qkv"]
            put_linear(f"{dst}self_attn.qkv_proj", qkv)
            if self.config.attention_bias:
                bias = [take(f"{attn}{p}_proj.bias") for p in "qkv"]
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat(bias))
            put_linear(f"{dst}self_attn.o_proj", [take(f"{attn}o_proj.weight")])
            mlp = f"{src}mlp."
            gate_up = [take(f"{mlp}gate_proj.weight"), take(f"{mlp}up_proj.weight")]
            put_linear(f"{dst}mlp.gate_up_proj", gate_up)
            put_linear(f"{dst}mlp.down_proj", [take(f"{mlp}down_proj.weight")])
        ignored = {"rope_freq_factors"} | {k for k in weights if k.endswith("rotary_emb.inv_freq")}
        unknown = set(weights) - used - ignored
        if self.config.tie_word_embeddings:
            unknown.discard("lm_head.weight")
        if unknown:
            raise ValueError(f"checkpoint has weights this model does not use: {sorted(unknown)[:5]}")
