"""A model's CPU weights gathered into one 2 MiB-aligned block in registration order
(inferd/layers/weight_arena.py): values, ties and quantized weights kept, views left alone, the
switch off leaves everything where it was; the engine's model and draft head live in one."""

from __future__ import annotations

import torch
from torch import nn

from inferd.layers.linear import Linear
from inferd.layers.quantized_linear import QuantizedLinear
from inferd.layers.weight_arena import gather_weights
from inferd.quantization.formats import quantize_int4
from tests.real_model import make_llm

_HUGE = 2 << 20


def _linear(n: int, k: int) -> Linear:
    lin = Linear(k, n)
    lin.weight.data.normal_()
    return lin


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.embed = nn.Embedding(1000, 256)
    m.a = _linear(1024, 256)  # 1 MiB
    m.b = _linear(1024, 256)
    m.q = QuantizedLinear(quantize_int4(torch.randn(512, 256)))
    m.head = _linear(1000, 256)
    m.head.weight = m.embed.weight  # tied
    m.wide = _linear(64, 512)
    m.view = _linear(64, 256)
    m.view.weight = nn.Parameter(m.wide.weight.data[:, :256], requires_grad=False)  # into `wide`
    return m


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}
    out |= {f"q.{k}": v.clone() for k, v in m.q.qweight.tensors().items()}
    return out


def test_weights_move_into_one_aligned_block_in_order(monkeypatch) -> None:
    monkeypatch.delenv("INFERD_WEIGHT_ARENA", raising=False)
    m = _model()
    before = _tensors(m)
    qw = m.q.qweight
    x = torch.randn(3, 256)
    ref = m.a(x), m.q(x)
    moved = gather_weights([m])
    own = [t for k, t in before.items() if k not in ("head.weight", "view.weight", "wide.weight")]
    assert moved >= sum(t.numel() * t.element_size() for t in own)
    after = _tensors(m)
    assert after.keys() == before.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), name
    # one block: registration order, each tensor after the last, the first on a 2 MiB boundary
    order = [m.embed.weight, m.a.weight, m.b.weight, qw.data, qw.scales, qw.mins]
    ptrs = [t.data_ptr() for t in order]
    assert ptrs[0] % _HUGE == 0
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < moved
    assert m.head.weight is m.embed.weight  # still tied: one Parameter, moved once
    assert m.q.qweight is qw  # the same QuantizedWeight, its tensors replaced
    # a view into another weight, and that weight, are not moved: they still share memory
    assert m.view.weight.data_ptr() == m.wide.weight.data_ptr()
    assert m.wide.weight.data_ptr() - ptrs[0] not in range(moved)
    # the moved weights work as before
    assert torch.equal(m.a(x), ref[0]) and torch.equal(m.q(x), ref[1])


def test_switched_off_or_too_small_moves_nothing(monkeypatch) -> None:
    m = _model()
    ptr = m.a.weight.data_ptr()
    monkeypatch.setenv("INFERD_WEIGHT_ARENA", "0")
    assert gather_weights([m]) == 0 and m.a.weight.data_ptr() == ptr
    monkeypatch.delenv("INFERD_WEIGHT_ARENA")
    small = _linear(16, 16)
    ptr = small.weight.data_ptr()
    assert gather_weights([small]) == 0 and small.weight.data_ptr() == ptr


def test_not_moved_where_the_copy_would_not_fit_in_memory(monkeypatch) -> None:
    import inferd.layers.weight_arena as arena

    m = _model()
    ptr = m.a.weight.data_ptr()
    monkeypatch.setattr(arena, "_available_memory", lambda: 3 << 20)  # 3 MiB free: too little
    assert gather_weights([m]) == 0 and m.a.weight.data_ptr() == ptr


def test_the_engines_model_is_one_block() -> None:
    llm = make_llm()
    model = llm.engine.runner.model
    weights = [p for p in model.parameters()]
    start = min(p.data_ptr() for p in weights)
    end = max(p.data_ptr() + p.numel() * p.element_size() for p in weights)
    total = sum(p.numel() * p.element_size() for p in weights)
    assert start % _HUGE == 0
    assert end - start < total + 64 * len(weights)  # contiguous but for cache-line padding
    layers = model.layers
    assert (
        layers[0].self_attn.qkv_proj.weight.data_ptr()
        < layers[1].self_attn.qkv_proj.weight.data_ptr()
    )
