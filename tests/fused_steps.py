"""Counting the steps that take the fused C++ decode step (csrc/decoder_layers.h)."""

from __future__ import annotations

from inferd.models import decoder


def count_fused_rows(monkeypatch) -> list[int]:
    """From now on (for the test), each fused step appends its row count to the returned list."""
    rows: list[int] = []
    real = decoder.DecoderForCausalLM._decode_layers

    def counted(self, ext, x, *args):
        rows.append(x.shape[0])
        return real(self, ext, x, *args)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "_decode_layers", counted)
    return rows
