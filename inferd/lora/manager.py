"""The engine's adapters: names registered (--lora-modules, LoRARequest paths, the load endpoint),
the loaded ones kept in host memory (at most --max-cpu-loras, least recently used dropped; read
again from their path, as a new load generation, when next asked for), and the slots a step runs
them in (slots.py). `NoLoRA` is the engine without --enable-lora.

A request's adapter is resolved once, when it is added: its sequences hold that load to the end,
so reloading or unloading a name never changes a request in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from inferd.config import LoRAConfig, ModelConfig
from inferd.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from inferd.lora.request import LoRARequest
from inferd.lora.slots import LoRASlots


class LoRANotFound(LoRAError):
    """A request or unload names an adapter that is not registered."""


class NoLoRA:
    """No adapters (--enable-lora off): a request naming one is refused."""

    enabled = False
    max_loras = 0
    slots = None

    def resolve(self, request: LoRARequest | None) -> LoRAAdapter | None:
        if request is not None:
            raise LoRAError(
                f"adapter {request.lora_name!r}: LoRA is not enabled (start the engine with --enable-lora)"
            )
        return None

    def names(self) -> dict[str, str]:
        return {}

    def activate(self, adapters: Iterable[LoRAAdapter]) -> None:
        pass


class LoRAManager:
    enabled = True

    def __init__(self, config: LoRAConfig, model: nn.Module, model_config: ModelConfig,
                 device: torch.device) -> None:  # fmt: skip
        self.config = config
        self.model_config = model_config
        self.max_loras = config.max_loras
        self.slots = LoRASlots(model, model_config, config.max_loras, config.max_lora_rank, device)
        model.set_lora(self.slots)
        self._paths: dict[str, str] = {}  # registered name → adapter directory
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # loaded, least recent first
        for name, path in config.modules.items():
            self.load(name, path)

    def names(self) -> dict[str, str]:
        """Registered adapters: name → path."""
        return dict(self._paths)

    def load(self, name: str, path: str, replace: bool = True) -> LoRAAdapter:
        """Register `name` as the adapter at `path` (read and checked now: LoRAError naming what
        does not fit); an existing name is replaced by a new load unless `replace` is False."""
        if not name:
            raise LoRAError("an adapter needs a name")
        if name in self._paths and not replace:
            raise LoRAError(f"adapter {name!r} is already loaded (unload it first)")
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank)
        self._paths[name] = str(path)
        self._keep(adapter)
        return adapter

    def unload(self, name: str) -> None:
        """Forget `name`; requests running under it finish under their load."""
        if self._paths.pop(name, None) is None:
            raise LoRANotFound(f"adapter {name!r} is not loaded")
        adapter = self._cpu.pop(name, None)
        if adapter is not None:
            self.slots.drop(adapter)

    def resolve(self, request: LoRARequest | None) -> LoRAAdapter | None:
        """The load a new request runs under (None: the base model)."""
        if request is None:
            return None
        name = request.lora_name
        if request.lora_path and self._paths.get(name) != str(request.lora_path):
            return self.load(name, request.lora_path)
        if name not in self._paths:
            raise LoRANotFound(f"adapter {name!r} is not loaded (known: {sorted(self._paths)})")
        adapter = self._cpu.get(name)
        if adapter is None:  # dropped from host memory: read again, as a new load
            adapter = load_adapter(
                name, self._paths[name], self.model_config, self.config.max_lora_rank
            )
            self._keep(adapter)
        self._cpu.move_to_end(name)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        old = self._cpu.pop(adapter.name, None)
        if old is not None:
            self.slots.drop(old)  # requests still under it take a slot again when scheduled
        self._cpu[adapter.name] = adapter
        while len(self._cpu) > self.config.cpu_capacity:
            self._cpu.popitem(last=False)

    def activate(self, adapters: Iterable[LoRAAdapter]) -> None:
        """The step's adapters (at most --max-loras distinct: the scheduler admits no more) into
        slots."""
        distinct = list({id(a): a for a in adapters}.values())
        if distinct:
            self.slots.assign(distinct)
