"""Debug endpoints (`--enable-debug-endpoints`): checks for tests and soaks, never for the open
internet (the leak check flushes the prefix cache).

POST /debug/check_no_leaks runs the engine's KV integrity check between steps when it is idle:
every block free or held by the prefix cache alone, and a flush of the cache empties the pool.
Every serving replica of every loaded model is checked; 200 `{"ok": true, ...}` (blocks summed) when it holds; 409 `engine_busy` while requests run; 500 `kv_leak` when
it fails.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from inferd.engine.core import EngineCore
from inferd.server.errors import APIError, api_errors
from inferd.server.served_models import ServedModels


def _check(core: EngineCore) -> dict[str, Any]:
    """In the engine, between steps."""
    if core.has_unfinished_requests() or core.has_pending_kv_transfers():
        return {"idle": False}
    try:
        core.check_no_leaks()
    except AssertionError as e:
        return {"idle": True, "ok": False, "error": str(e) or "integrity check failed"}
    pool = core.kv.pool
    return {"idle": True, "ok": True, "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free}  # fmt: skip


def install_debug_routes(app: FastAPI, served: ServedModels) -> None:
    @app.post("/debug/check_no_leaks")
    @api_errors
    async def check_no_leaks() -> dict[str, Any]:
        results = [r for s in served.loaded() for r in await s.ready_replicas().call_all(_check)]
        if not all(r["idle"] for r in results):
            raise APIError(409, "requests are running; retry when the engine is idle",
                           code="engine_busy")  # fmt: skip
        if failed := [r["error"] for r in results if not r["ok"]]:
            raise APIError(500, f"KV integrity check failed: {'; '.join(failed)}", code="kv_leak")
        # Summed over the serving replicas (of every loaded model).
        return {"ok": True, "num_total_blocks": sum(r["num_total_blocks"] for r in results),
                "num_free_blocks": sum(r["num_free_blocks"] for r in results)}  # fmt: skip
