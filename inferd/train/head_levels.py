"""The learned draft head's chains unrolled over whole sequences, as training runs them.

Training cannot afford the engine's chain per starting position: `forward_levels` computes level l
(chain step l + 1) for every position of a padded batch at once, with the attention masked so
that each row sees exactly the keys the engine's chain would. Up to a chain's first wrong draft,
drafted tokens are the true ones, so its features are the engine's: the training loss and the
offline acceptance measurement both read them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferd.spec.eagle_head import EagleHead


def forward_levels(
    head: EagleHead,
    hidden: torch.Tensor,  # [B, T, H] the target's hidden states
    tokens: torch.Tensor,  # [B, T]
    lengths: torch.Tensor,  # [B] real length of each (padded) sequence
    levels: int,
    embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The features [B, T - 1, H] of `levels` chained steps of `head`, drafting from every
    position at once, each position p of level l (l = 0..levels-1) computed as the engine would at
    chain step l + 1 from start t = p - l: its input pairs level l - 1's prediction at p - 1 with
    the true token p + 1 (at level 0, the target's h_p), and its attention sees the true keys of
    positions <= t plus the chain's own keys at t + 1..p (one from each earlier level). Rows of
    level l predict the target's hidden state at p + 1; those with p < l are meaningless."""
    if int(lengths.min()) < 2:
        raise ValueError("every sequence needs at least 2 tokens")
    hidden = head.target_features(hidden)
    b, t1 = hidden.shape[0], hidden.shape[1] - 1
    pos = torch.arange(t1, device=hidden.device)
    positions = pos.expand(b, t1)
    key_ok = pos[None, :] < (lengths[:, None] - 1)  # [B, T-1] a real position with a next token
    scale = head.head_dim**-0.5
    group = head.num_heads // head.num_kv_heads
    feats: list[torch.Tensor] = []
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # per level: [B, T-1, KVH, D] each
    prev = hidden[:, :-1]
    for level in range(levels):
        if level == 0:
            x = head.inputs(prev, tokens[:, 1:], embed_fn)
        else:  # prediction of h_p from position p - 1, with the token at p + 1
            shifted = torch.cat([prev[:, :1], prev[:, :-1]], dim=1)
            x = head.inputs(shifted, tokens[:, 1:], embed_fn)
        q, k, v = head.qkv_of(x, positions)
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
        feature = head.finish(x, out.transpose(1, 2))
        feats.append(feature)
        prev = feature
    return feats
