"""LoRA adapters over HTTP, as vLLM serves them: `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}`, `POST /v1/unload_lora_adapter {"lora_name"}` (behind the API key when one is set,
like every route), adapters listed by /v1/models with `parent` = the base model, and a request's
`model` field naming an adapter runs under it.

The front end keeps the names (`ServerState.lora_modules`) so that an unknown `model` is a 404
before anything reaches an engine; the engines hold the weights (inferd/lora/manager.py). Loads
and unloads go to every serving replica.
"""

from __future__ import annotations

import functools

from fastapi import FastAPI
from pydantic import BaseModel

from inferd.lora.adapter import LoRAError
from inferd.lora.manager import LoRANotFound
from inferd.server.errors import APIError, api_errors
from inferd.server.protocol import ModelCard
from inferd.server.serving_common import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _load(name: str, path: str, replace: bool, core) -> None:
    core.lora.load(name, path, replace=replace)


def _unload(name: str, core) -> None:
    core.lora.unload(name)


def adapter_cards(state: ServerState, created: int, max_model_len: int | None) -> list[ModelCard]:
    """/v1/models' entries of the adapters."""
    return [ModelCard(id=name, created=created, root=path, parent=state.model_name, max_model_len=max_model_len)
            for name, path in state.lora_modules.items()]  # fmt: skip


def install_lora_routes(app: FastAPI, state: ServerState) -> None:
    def check_enabled() -> None:
        if not state.enable_lora:
            raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")

    @app.post("/v1/load_lora_adapter")
    @api_errors
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> dict[str, str]:
        check_enabled()
        name = req.lora_name
        if not name or name in state.served_model_names:
            raise APIError(
                400, f"lora_name {name!r} is empty or the base model's name", param="lora_name"
            )
        if name in state.lora_modules and not req.load_inplace:
            raise APIError(400, f"adapter {name!r} is already loaded (unload it first, or load_inplace)",
                           param="lora_name")  # fmt: skip
        try:
            await state.ready_replicas().call_all(
                functools.partial(_load, name, req.lora_path, True)
            )
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        state.lora_modules[name] = req.lora_path
        return {"status": "ok", "message": f"adapter {name!r} loaded"}

    @app.post("/v1/unload_lora_adapter")
    @api_errors
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> dict[str, str]:
        check_enabled()
        name = req.lora_name
        if name not in state.lora_modules:
            raise APIError(
                404, f"adapter {name!r} is not loaded", param="lora_name", code="model_not_found"
            )
        state.lora_modules.pop(name)
        try:
            await state.ready_replicas().call_all(functools.partial(_unload, name))
        except LoRANotFound:
            pass  # a replica restarted without it: gone there already
        return {"status": "ok", "message": f"adapter {name!r} unloaded"}
