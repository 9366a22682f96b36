"""Which models a server serves, and the one place that maps a request's `model` to the state
that serves it (`ServedModels.serving`).

`inferd serve PATH` serves one model, loaded at start, as it always has. `inferd serve a=PATH_A
b=PATH_B` (or any of the pool's flags) serves several from a `ModelPool` (model_pool.py): each
loaded on first use in engine processes of its own, unloaded least-recently-used under
`--max-loaded-models` / `--models-memory`, `--pin` keeps one loaded, `--model-ttl` unloads an idle
one. Requests waiting for their model to load count against `--max-queue-len`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferd.engine_args import parse_bytes
from inferd.server.errors import APIError
from inferd.server.protocol import ModelCard
from inferd.server.serving_common import ServerState

if TYPE_CHECKING:
    from inferd.server.model_pool import ModelPool


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # what a request's `model` says
    path: str  # GGUF file or HF directory
    kv_cache_memory: int | None = None  # --kv-cache-memory, when fixed: part of the estimate

    @property
    def estimated_bytes(self) -> int:
        """Resident bytes before the first load: the weights' file size plus a fixed KV pool."""
        p = Path(self.path)
        try:
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() \
                else p.stat().st_size  # fmt: skip
        except OSError:
            size = 0
        return size + (self.kv_cache_memory or 0)


@dataclass(frozen=True, slots=True)
class ModelPoolConfig:
    models: tuple[ModelSpec, ...]
    max_loaded_models: int | None = None  # None: no limit on the count
    models_memory: int | None = None  # bytes of weights + KV pools of loaded models; None: any
    pins: tuple[str, ...] = ()
    model_ttl: float | None = None  # seconds idle before an unload; None: never
    max_swap_queue_len: int | None = None  # requests waiting for a load; None: no limit

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"the model name {dup!r} is given twice; name each as NAME=PATH")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded_models}")
        if self.models_memory is not None and self.models_memory < 1:
            raise ValueError(f"--models-memory must be > 0, got {self.models_memory}")
        if self.model_ttl is not None and self.model_ttl <= 0:
            raise ValueError(f"--model-ttl must be > 0 seconds, got {self.model_ttl}")
        if unknown := [p for p in self.pins if p not in names]:
            raise ValueError(f"--pin {unknown[0]!r} is not a served model ({', '.join(names)})")
        cap = self.max_loaded_models
        if cap is not None and len(set(self.pins)) >= cap and len(names) > len(set(self.pins)):
            raise ValueError(f"--pin keeps {len(set(self.pins))} model(s) loaded, which leaves no "
                             f"room under --max-loaded-models {cap} for the others")  # fmt: skip


def add_model_pool_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("several models (serve NAME=PATH NAME=PATH ...)")
    g.add_argument("--max-loaded-models", type=int, default=None,
                   help="models loaded at once; loading one more unloads the least recently "
                   "used idle one (default: no limit)")  # fmt: skip
    g.add_argument("--models-memory", type=parse_bytes, default=None,
                   help="bytes the loaded models' weights and KV pools may take together, e.g. "
                   "8GiB (measured at load; estimated from the file before the first)")  # fmt: skip
    g.add_argument("--pin", action="append", default=[], metavar="NAME",
                   help="keep this model loaded from the start; never unloaded (repeatable)")
    g.add_argument("--model-ttl", type=float, default=None, metavar="SECONDS",
                   help="unload a model idle this long (default: never)")


def parse_model_arg(text: str) -> tuple[str | None, str]:
    """`PATH` → (None, PATH); `NAME=PATH` → (NAME, PATH). A path with `=` in it that exists on
    disk is a path."""
    name, sep, path = text.partition("=")
    if not sep or os.path.exists(text):
        return None, text
    if not name or not path:
        raise ValueError(f"model argument {text!r}: give PATH or NAME=PATH")
    return name, path


def uses_pool(args: argparse.Namespace) -> bool:
    """Several models, a named one, or a pool flag: the pool serves; else the single model."""
    models = args.models
    named = any(parse_model_arg(m)[0] is not None for m in models)
    flags = (args.max_loaded_models, args.models_memory, args.model_ttl)
    return len(models) > 1 or named or bool(args.pin) or any(f is not None for f in flags)


def model_pool_config(args: argparse.Namespace) -> ModelPoolConfig:
    """The pool `args` ask for; ValueError for what cannot be served together."""
    if args.served_model_name:
        raise ValueError("--served-model-name serves one model; with several, name each as "
                         "NAME=PATH")  # fmt: skip
    if args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 with several models is not supported; run a "
                         "server per model behind `inferd router`")  # fmt: skip
    specs = []
    for text in args.models:
        name, path = parse_model_arg(text)
        specs.append(ModelSpec(name or path, path, args.kv_cache_memory))
    queue = args.max_queue_len or None
    return ModelPoolConfig(tuple(specs), args.max_loaded_models, args.models_memory,
                           tuple(args.pin), args.model_ttl, queue)  # fmt: skip


class ServedModels:
    """Maps a request's `model` to the `ServerState` that serves it: the one state of a
    single-model server, or a per-request state over the pool's replicas of that model."""

    def __init__(self, base: ServerState, pool: ModelPool | None = None) -> None:
        self.base = base
        self.pool = pool

    @asynccontextmanager
    async def serving(self, model: str | None) -> AsyncIterator[ServerState]:
        """The state serving `model` (404 for one not served), its model loaded and kept loaded
        until the block ends."""
        if self.pool is None:
            self.base.check_model(model)
            yield self.base
            return
        async with self.pool.use(model) as (name, replicas):
            yield dataclasses.replace(self.base, replicas=replicas, served_model_names=[name])

    def loaded(self) -> list[ServerState]:
        """The states of the models loaded now (a single model: its state, loaded or not)."""
        if self.pool is None:
            return [self.base]
        return [
            dataclasses.replace(self.base, replicas=e.replicas, served_model_names=[name])
            for name, e in self.pool.entries.items()
            if e.replicas is not None and e.replicas.ready
        ]

    def cards(self) -> list[ModelCard]:
        if self.pool is None:
            info = self.base.ready_replicas().info
            source = info.source if info is not None else None
            return [
                ModelCard(id=name, created=self.base.created, root=str(source) if source else None,
                          max_model_len=self.base.max_model_len, loaded=True)  # fmt: skip
                for name in self.base.served_model_names
            ]
        cards = []
        for name, e in self.pool.entries.items():
            info = e.replicas.info if e.replicas is not None else None
            cards.append(ModelCard(id=name, created=self.base.created, root=e.spec.path,
                                   max_model_len=info.max_model_len if info else None,
                                   loaded=info is not None))  # fmt: skip
        return cards

    def health(self) -> tuple[APIError | None, dict[str, Any]]:
        """A single model: its replicas' health. A pool: 200 once every pinned model serves
        (the others load on demand); the statuses name what is loaded."""
        if self.pool is None:
            return self.base.replicas.health()
        pool = self.pool
        statuses: dict[str, Any] = {}
        for name, e in pool.entries.items():
            if e.replicas is not None:
                error, _ = e.replicas.health()
                statuses[name] = "ok" if error is None else error.code
            else:
                statuses[name] = "not_loaded"
        for name in pool.config.pins:
            if name in pool.pin_errors:
                return APIError(503, pool.pin_errors[name], code="engine_dead"), statuses
            if statuses[name] != "ok":
                return APIError(503, f"the pinned model `{name}` is still loading; retry "
                                "shortly", code="model_loading"), statuses  # fmt: skip
        return None, statuses

    def render_metrics(self) -> bytes:
        if self.pool is None:
            return self.base.replicas.render_metrics()
        from inferd.server.model_metrics import render_models

        loaded = {n: e.replicas for n, e in self.pool.entries.items() if e.replicas is not None}
        return render_models(self.pool.metrics.registry, loaded)
