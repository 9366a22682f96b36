"""Logits processors applied before sampling: logit_bias, min_tokens, repetition / presence /
frequency penalties. Each touches only the rows whose requests ask for it."""

from __future__ import annotations

import torch

from inferd.scheduler.sequence import Sequence


def apply_processors(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
) -> torch.Tensor:
    touched = False
    for i, seq in enumerate(seqs):
        p = seq.params
        needs = (
            p.logit_bias
            or seq.num_output_tokens < p.min_tokens
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
        )
        if not needs:
            continue
        if not touched:
            logits = logits.clone()  # never modify the model's output tensor in place
            touched = True
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device,
                                                dtype=row.dtype))  # fmt: skip
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or [])
            if not p.ignore_eos:
                banned += list(eos_token_ids)
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            # HF/vLLM semantics: every token seen in prompt or output; shrink toward "less likely".
            seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            # OpenAI semantics: over generated tokens only.
            out = seq.output_token_ids
            if out:
                counts = torch.bincount(torch.tensor(out, device=row.device), minlength=row.shape[0])
                counts = counts[: row.shape[0]].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits
