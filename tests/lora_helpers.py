"""Writers of PEFT LoRA adapters for the LoRA tests, and HF transformers + PEFT references.

Adapters are made by PEFT itself (`get_peft_model` with `init_lora_weights=False`, so B != 0)
and saved with `save_pretrained`: the engine reads what PEFT writes. The reference is the HF
model with the adapter merged into its weights (`merge_and_unload`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base, out: Path, seed: int, rank: int = 8, alpha: int = 16,
                  targets: list[str] | None = None, scale: float = 1.0, **config) -> Path:  # fmt: skip
    """A random LoRA adapter of HF model `base` (left untouched) saved under `out`. `scale`
    multiplies B (how far the adapter moves the model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     init_lora_weights=False, **config)  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out))
    return out


def merged(base, adapter: Path):
    """HF `base` (left untouched) with the adapter at `adapter` merged into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).merge_and_unload().eval()


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
