"""Multi-head latent attention (DeepSeek-V2), in its absorbed form over a latent KV cache.

Each token's keys and values come from one compressed latent c (`kv_lora_rank` wide, after its
RMSNorm) and one rotary key k_pe (`head_dim` wide) that all heads share. The KV cache holds
[c ; k_pe] per token and layer, one "head" (config.kv_layout): not 2 · heads · head size.

The checkpoint's kv_b_proj maps c to each head's non-rotary key and value: k_nope = W_UK · c,
v = W_UV · c. Attention never expands them: a head's query is absorbed into latent space,
q_lat = W_UKᵀ · q_nope, so that q · k = q_lat · c + q_pe · k_pe, i.e. the query [q_lat ; q_pe]
against the cached [c ; k_pe] as one shared key head (multi-query attention); the values are the
cached latents too (their k_pe part is ignored), and a head's output W_UV · (Σ p · c) goes to
o_proj. Every path (prefill, chunks, prefix-cache hits, decodes) runs this form through the
model's attention backend and paged cache; `expanded_reference` computes the textbook form
(k and v expanded per head), which the tests compare it with.

DeepSeek's checkpoints rotate (x[2i], x[2i+1]) pairs; inferd's rotary rotates (x[i], x[i + d/2]).
The rows that make q_pe and k_pe are permuted at load into that order: q_pe · k_pe is unchanged
(both permuted alike) and the rotation becomes inferd's.
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.config import ModelConfig
from inferd.layers.attention import AttentionBackend, AttentionMetadata
from inferd.layers.linear import Linear
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import Rotate
from inferd.models.spec import LayerSpec


def _deinterleave(rows: int) -> torch.Tensor:
    """Row order taking interleaved rotary pairs to halves: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope_index: int) -> None:
        super().__init__()
        self.n_heads, self.rank, self.rope_dim = cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        q_width = self.n_heads * (self.nope + self.rope_dim)
        self.q_lora = cfg.q_lora_rank
        if self.q_lora:
            self.q_a_proj = Linear(cfg.hidden_size, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora, q_width, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.o_proj = Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.scale = spec.attn_scale
        self.rope_index = rope_index
        # kv_b_proj split per head, fp32 (set at load): W_UK [H, nope, rank], W_UV [H, v, rank].
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None  # select_kernels
        self.dense = None  # the C++ kernels' extension, for per_head (select_kernels)
        self.rotate: Rotate | None = None

    def load(self, src: str, dst: str, take, put, put_norm, put_linear) -> None:
        """The checkpoint's MLA tensors (HF names under `src`); q_pe's and k_pe's rows put into
        halves order; kv_b_proj split into W_UK and W_UV."""
        h, nope, rope, rank = self.n_heads, self.nope, self.rope_dim, self.rank
        head_rows = torch.cat([torch.arange(nope), nope + _deinterleave(rope)])
        q_rows = torch.cat([i * (nope + rope) + head_rows for i in range(h)])
        if self.q_lora:
            put_linear(f"{dst}q_a_proj", [take(f"{src}q_a_proj.weight")])
            put_norm(f"{dst}q_a_layernorm.weight", take(f"{src}q_a_layernorm.weight"))
            put_linear(f"{dst}q_b_proj", [_rows(take(f"{src}q_b_proj.weight"), q_rows)])
        else:
            put_linear(f"{dst}q_proj", [_rows(take(f"{src}q_proj.weight"), q_rows)])
        kv_rows = torch.cat([torch.arange(rank), rank + _deinterleave(rope)])
        put_linear(f"{dst}kv_a_proj_with_mqa", [_rows(take(f"{src}kv_a_proj_with_mqa.weight"), kv_rows)])
        put_norm(f"{dst}kv_a_layernorm.weight", take(f"{src}kv_a_layernorm.weight"))
        kv_b = _dense(take(f"{src}kv_b_proj.weight")).view(h, nope + self.v_dim, rank)
        device = self.kv_a_layernorm.weight.device
        self.w_uk = kv_b[:, :nope].contiguous().to(device)
        self.w_uk_t = self.w_uk.transpose(1, 2).contiguous()  # [H, rank, nope]: q_nope → latent
        self.w_uv = kv_b[:, nope:].contiguous().to(device)
        put_linear(f"{dst}o_proj", [take(f"{src}o_proj.weight")])

    def _project(self, x: torch.Tensor, ropes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, nope], q_pe rotated [T, H, rope], latent [c ; k_pe rotated] [T, 1, rank + rope])."""
        t = x.shape[0]
        q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x))) if self.q_lora \
            else self.q_proj.forward(x)  # fmt: skip
        q_nope, q_pe = q.view(t, self.n_heads, -1).split_with_sizes([self.nope, self.rope_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa.forward(x).split_with_sizes([self.rank, self.rope_dim], -1)
        cos, sin = ropes[self.rope_index]
        q_pe = self.rotate(q_pe.contiguous(), cos, sin)
        k_pe = self.rotate(k_pe.contiguous().view(t, 1, self.rope_dim), cos, sin)
        latent = torch.cat([self.kv_a_layernorm.forward(c.contiguous()).view(t, 1, self.rank), k_pe], -1)
        return q_nope, q_pe, latent

    def forward(self, x: torch.Tensor, ropes, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_nope, q_pe, latent = self._project(x, ropes)
        q_lat = self.per_head(q_nope, self.w_uk_t)  # [T, H, rank]
        q = torch.cat([q_lat, q_pe], -1)
        # One key head, the latent, serves as keys and as values (its rotary part ignored below).
        o = self.backend.forward(q, latent, latent, kv_cache[0], kv_cache[1], meta, self.scale, None, None)
        o_lat = o.view(t, self.n_heads, -1)[..., : self.rank]
        out = self.per_head(o_lat, self.w_uv)  # [T, H, v]
        return self.o_proj.forward(out.reshape(t, self.n_heads * self.v_dim))

    def per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H, K], w [H, N, K] → [T, H, N], head h's rows times w[h]ᵀ. On the CPU in fp32 one
        dense-kernel call per head, whose row sums do not depend on T (bmm's blocking does)."""
        if self.dense is None:
            return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
        return torch.stack([self.dense.dense_linear(x[:, h], w[h], None) for h in range(self.n_heads)], 1)

    def expanded_reference(self, x: torch.Tensor, ropes) -> torch.Tensor:
        """Causal attention of `x`'s rows among themselves in the textbook form (keys and values
        expanded per head from the latent, SDPA): what `forward` computes absorbed."""
        t = x.shape[0]
        q_nope, q_pe, latent = self._project(x, ropes)
        c, k_pe = latent[:, 0, : self.rank], latent[:, :, self.rank :]
        k_nope = torch.einsum("tr,hnr->thn", c, self.w_uk)
        v = torch.einsum("tr,hvr->thv", c, self.w_uv)
        k = torch.cat([k_nope, k_pe.expand(t, self.n_heads, self.rope_dim)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale
        )
        return self.o_proj.forward(o.transpose(0, 1).reshape(t, self.n_heads * self.v_dim))


def _dense(w) -> torch.Tensor:
    """A checkpoint tensor as fp32 (a quantized one dequantized)."""
    if isinstance(w, torch.Tensor):
        return w.float()
    from inferd.quantization.formats import dequantize

    return dequantize(w)


def _rows(w, rows: torch.Tensor):
    """`w`'s rows in the order `rows` gives (a packed weight stays packed)."""
    return w[rows] if isinstance(w, torch.Tensor) else w.rows(rows)
