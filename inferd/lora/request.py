"""`LoRARequest`: which adapter a request runs under, as vLLM's `vllm.lora.request.LoRARequest`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_name` selects the adapter; `lora_path` (a PEFT adapter directory) registers it under
    that name if it is not yet (a different path re-registers it: a new load, new KV).
    `lora_int_id` is accepted for vLLM's signature; the name is the key."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
