"""LoRA adapters served batched with their base model: PEFT loading (adapter.py), the slots and
batched delta (slots.py), the registry and host-memory cache (manager.py)."""

from inferd.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from inferd.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAError", "LoRARequest", "load_adapter"]
