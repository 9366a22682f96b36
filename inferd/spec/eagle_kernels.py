"""The learned draft head at inference time on the CPU: its quantized layers and the C++ glue.

`EagleHead.for_inference` swaps the head's training layers for the engine's
(`use_inference_layers`); from then on a draft step runs the same C++ kernels as the target's
decode step, and greedy chains run entirely in C++ (csrc/eagle_draft.h, `draft_fused`) where
every weight is in a layout that chain reads. Without the kernels, the head's plain-op paths
compute the same tokens.

These functions read and cache state the head keeps outside its module tree (`head.__dict__`:
`_kernels`, `_draft_vocab`, `_exact_from`, `_fused`), which the head resets whenever its weights
or its target change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from inferd.sampling.sampler import argmax_rows
from inferd.spec.draft_cache import DraftCache

if TYPE_CHECKING:
    from inferd.spec.eagle_head import EagleHead

# A quantized draft vocabulary's scores within RESCORE_WITHIN of a step's best are rescored in
# fp32 (at most RESCORE_MAX of them): int4 rounding moves the default model's head's scores by up
# to about 1.7, so a margin of 2 keeps every token whose rank rounding could have changed.
RESCORE_WITHIN = 2.0
RESCORE_MAX = 16
# A ranked chain's alternatives at each depth: the runner-up and the third likeliest token
# (csrc/eagle_draft.h kAlternatives, the same number).
ALTERNATIVES = 2


def draft_linear(weight: torch.Tensor) -> nn.Module:
    """An fp32 CPU weight [N, K] as the linear the engine's draft steps run: int4 in groups of 32
    (fp16 scale and min each) in the engine's packed tiles where the CPU takes them, else int8
    per output channel.

    Why int4: a draft step streams every weight of the head (most of it the draft vocabulary's LM
    head rows) from memory the target's forward has just swept, k times per target step, so the
    bytes read are most of its time. Drafts only rank tokens; verification scores the target's own
    logits, so the rounding can cost acceptance but never changes an output."""
    from inferd.layers.quantized_linear import QuantizedLinear
    from inferd.quantization.formats import pack_tiles, quantize_int4, quantize_int8

    packed = pack_tiles(quantize_int4(weight)) if weight.shape[1] % 32 == 0 else None
    if packed is None:
        q = quantize_int8(weight)
        packed = pack_tiles(q) or q
    # Read k times a step and small: kept in cache, not streamed past it as a model's weights are.
    packed.streamed = False
    return QuantizedLinear(packed)


def use_inference_layers(head: EagleHead, quantize: bool) -> None:
    """Swap the head's layers for the engine's inference ones, in place (no training after this):
    RMSNorms and linears with the C++ kernels the target's decode step runs, the linears quantized
    (`draft_linear`) when `quantize`. A draft step reads every weight of the head once and the
    chain runs it k times per target step, so in fp32 that streaming is most of its time."""
    from inferd.kernels.quant_gemm import extension
    from inferd.layers.linear import Linear
    from inferd.layers.norm import RMSNorm

    for name, module in list(head.named_children()):
        if isinstance(module, nn.RMSNorm):
            norm = RMSNorm(head.hidden_size, head.rms_norm_eps).to(module.weight.device)
            norm.weight.data = module.weight.data.float()
            setattr(head, name, norm)
        elif isinstance(module, nn.Linear):
            w = module.weight.data
            if quantize and w.is_cpu:
                setattr(head, name, draft_linear(w))
            else:
                lin = Linear(w.shape[1], w.shape[0]).to(w.device)
                lin.weight.data = w
                setattr(head, name, lin)
    weight = head.out_norm.weight
    # The draft step's elementwise ops and its attention as the target's decode step runs them
    # (csrc/layer_ops.h, paged_attention.h): one C++ call each instead of ~30 small ATen ops,
    # which at batch 1 would be most of a draft step's time.
    head.__dict__["_kernels"] = (
        extension() if weight.is_cpu and weight.dtype == torch.float32 else None
    )
    head.__dict__["_fused"] = None


def runner_ups(
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


def rescore_close(
    head: EagleHead, scores: torch.Tensor, feature: torch.Tensor, ids: torch.Tensor
) -> None:
    """In place: each row's scores within RESCORE_WITHIN of its max (at most RESCORE_MAX of them)
    replaced by the target's fp32 LM head's (csrc/eagle_draft.h `rescore_close`, the C++ chain's,
    the same bits; without the kernels, ATen's, equal within rounding)."""
    table = head._exact_from.weight.detach()
    rows = scores.view(-1, scores.shape[-1])  # a linear's fresh output: a view, written through
    x = feature.reshape(-1, feature.shape[-1]).contiguous()
    ext = head._kernels
    if ext is not None and scores.is_cpu:
        ext.eagle_rescore_close(
            rows, x, ids.long().contiguous(), table, RESCORE_WITHIN, RESCORE_MAX
        )
        return
    top, at = rows.topk(min(RESCORE_MAX, rows.shape[-1]), dim=-1)
    close = top >= rows.max(-1, keepdim=True).values - RESCORE_WITHIN
    exact = torch.einsum("bh,bch->bc", x.float(), table[ids[at]].float())
    rows.scatter_(-1, at, torch.where(close, exact.to(top.dtype), top))


def fused_weights(head: EagleHead) -> Any:
    """The head as the C++ chain takes it (csrc/eagle_draft.h), built once; None where that chain
    would not run the Python one's kernels: linears other than quantized ones without bias (packed
    tiles where int8 activations are on, or the row layout: an AVX2-only CPU's, with fp32
    activations), no draft vocabulary, an embedding neither fp32 nor quantized."""
    cached = head.__dict__.get("_fused")
    if cached is not None:
        return cached or None
    from inferd.layers.linear import Embedding
    from inferd.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
    from inferd.models.decoder import kernel_linear_weights
    from inferd.quantization import formats

    ext, fused = head._kernels, False
    int8 = ext is not None and formats.int8_activations_default(ext)

    def same_kernel(m: nn.Module) -> bool:
        # decoder::linear dispatches a quantized weight as quantized_matmul does; packed tiles
        # under fp32 activations are dequantised in Python instead, so not those.
        return (
            isinstance(m, QuantizedLinear)
            and m.bias is None
            and (m.qweight.layout == "rows" or int8)
        )

    linears = [head.fc, head.qkv, head.o_proj, head.gate_up, head.down]
    if head._draft_vocab is not None:
        linears.append(head._draft_vocab[1])
    embed = head.target.embed_tokens if head._target is not None else None
    table = (isinstance(embed, Embedding) and embed.weight.dtype == torch.float32) or (
        isinstance(embed, QuantizedEmbedding)
        and embed.dtype == torch.float32
        and embed.qweight.format in ("int8", "int4", "fp8")  # the tables embedding_rows reads
        and (embed.qweight.layout == "rows" or int8)
    )
    if ext is not None and len(linears) == 6 and all(map(same_kernel, linears)) and table:
        norms = [
            n.weight
            for n in (
                head.hidden_norm,
                head.embed_norm,
                head.attn_norm,
                head.mlp_norm,
                head.out_norm,
            )
        ]
        kinds = [kernel_linear_weights(ext, m) for m in linears]
        exact = {}
        if head._exact_from is not None:
            exact = {
                "exact": head._exact_from.weight.detach(),
                "exact_within": RESCORE_WITHIN,
                "exact_max": RESCORE_MAX,
            }
        fused = ext.EagleHeadWeights(
            norms, kinds, head._draft_vocab[0].long(), kernel_linear_weights(ext, embed), **exact
        )
    head.__dict__["_fused"] = fused
    return fused or None


def fused_shape(head: EagleHead) -> Any:
    """The head's sizes as the C++ decoder kernels take them, built once."""
    shape = head.__dict__.get("_kernel_shape")
    if shape is None:
        from inferd.quantization import formats

        ext = head._kernels
        shape = ext.DecoderShape(
            head.num_heads,
            head.num_kv_heads,
            head.head_dim,
            head.intermediate_size,
            head.rms_norm_eps,
            head.head_dim**-0.5,
            formats.int8_activations_default(ext),
        )
        head.__dict__["_kernel_shape"] = shape
    return shape


def draft_fused(
    head: EagleHead, fused: Any, caches: list[DraftCache], k: int, confidences: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`EagleHead.draft`'s greedy chains in one C++ call: the same tokens, the same keys left
    behind; (tokens, runner-ups, probabilities), the last two empty unless `confidences`."""
    for c in caches:
        c.reserve(k)
    x = torch.stack([c.x_last for c in caches])
    ends = [c.end - 1 for c in caches]
    pos = torch.tensor(ends)
    cos, sin = head.rope_full_table(max(ends) + k, pos.device)  # reaching every chain position
    return head._kernels.eagle_draft_chains(
        fused,
        fused_shape(head),
        x,
        pos,
        [c.k for c in caches],
        [c.v for c in caches],
        [c.end - c.lo for c in caches],
        cos,
        sin,
        k,
        confidences,
    )
