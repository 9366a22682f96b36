"""Engine replicas as Ray actors (`--distributed-executor-backend ray`): each replica's engine
runs in an actor placed in a placement group of its own on an existing Ray cluster.

    front end (AsyncEngine)                       Ray actor `EngineActor` (a node of the cluster)
    -----------------------                       ----------------------------------------------
    send() ── writer thread ── push(commands) ──► a ThreadBackend: the engine loop on a thread
    on_message ◄── reader thread ◄── pull() ◄──── its messages, as engine_proc encodes them

`pull` is a long poll: it returns the messages queued since the last one, waiting up to a second
for the first. Commands go one `push` at a time, so they arrive in order. An actor that dies (its
process killed, its node lost) makes `pull` raise: the front end reports the engine's exit and
the replica's supervisor starts a fresh actor in a fresh placement group.

Ray does the cluster's work (placement, processes, transport, failure detection); this module
only adapts its calls to the engine's command and message streams. Each actor needs inferd, its
model file (the same path) and the kernels' compiler on its node; the front end's INFERD_*
variables and its inferd's location travel to the actors in their runtime environment.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle

from inferd.distributed.ray_ranks import import_ray, rank_bundles, runtime_env, wait_placed
from inferd.engine.async_engine import ThreadBackend
from inferd.engine.core import EngineCore
from inferd.engine.engine_loop import Command, Exited, Loaded, Message
from inferd.engine.engine_proc import decode_message, encode_message

logger = logging.getLogger("inferd.async_engine")

_PULL_WAIT_S = 1.0
_STOP = None


class EngineActor:
    """The engine loop inside a Ray actor (a threaded actor: `pull` waits while `push` runs)."""

    def __init__(self, factory_blob: bytes, stream_interval: int, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self._cv = threading.Condition()  # guards `_outbox`
        self._outbox: deque[bytes] = deque()
        self._engine = ThreadBackend(cloudpickle.loads(factory_blob), stream_interval)
        self._engine.start_delivering(self._emit)

    def _emit(self, message: Message) -> None:
        blob = encode_message(message)
        with self._cv:
            self._outbox.append(blob)
            self._cv.notify()

    def push(self, blob: bytes) -> None:
        commands: list[Command | None] = pickle.loads(blob)
        for command in commands:
            if command is _STOP:
                self._engine.stop(timeout=30)
                return
            self._engine.send(command)

    def pull(self, wait_s: float) -> list[bytes]:
        with self._cv:
            if not self._outbox:
                self._cv.wait(wait_s)
            messages = list(self._outbox)
            self._outbox.clear()
        return messages

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayBackend:
    """An `EngineBackend` whose engine is an `EngineActor` in a placement group of its own: one
    bundle of `threads` CPUs per tensor-parallel rank, the actor (rank 0) in bundle 0 and its
    worker ranks' actors in the others (inferd/distributed/ray_ranks.py)."""

    core: EngineCore | None = None  # never in this process

    def __init__(
        self,
        factory_blob: bytes,
        threads: int,
        stream_interval: int,
        runtime_env: dict[str, Any],
        ranks: int = 1,
        strategy: str = "STRICT_PACK",
    ) -> None:
        self._factory_blob = factory_blob
        self._threads = threads
        self._ranks, self._strategy = ranks, strategy
        self._stream_interval = stream_interval
        self._runtime_env = runtime_env
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._alive = False
        self._stopping = False
        self._actor: Any = None
        self._group: Any = None
        self._reader: threading.Thread | None = None

    def fresh(self) -> RayBackend:
        """A backend like this one, not started: the supervisor's replacement engine."""
        return RayBackend(self._factory_blob, self._threads, self._stream_interval,
                          self._runtime_env, self._ranks, self._strategy)  # fmt: skip

    @property
    def is_alive(self) -> bool:
        return self._alive

    def cpu_seconds(self) -> float | None:
        return None  # on another node: the heartbeat goes by the actor's messages alone

    def send(self, command: Command) -> None:
        self._outbox.put(command)

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        def deliver(message: Message) -> None:
            if isinstance(message, Exited):
                self._alive = False
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        self._alive = True
        self._reader = threading.Thread(target=self._run, args=(deliver,), daemon=True,
                                        name="inferd-ray-reader")  # fmt: skip
        self._reader.start()

    def _run(self, deliver: Callable[[Message], None]) -> None:
        """Place the actor, then relay its messages until it stops or dies."""
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            self._group = placement_group(rank_bundles(self._ranks, self._threads),
                                          strategy=self._strategy)  # fmt: skip
            what = f"this replica's {self._ranks} bundle(s) of {self._threads} CPU(s)"
            try:
                wait_placed(ray, self._group, what)
            except RuntimeError:
                self._group = None  # removed
                raise
            actor_class = ray.remote(EngineActor)
            self._actor = actor_class.options(
                num_cpus=self._threads,
                max_concurrency=4,  # pull and push run while the engine thread steps
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, 0),
                runtime_env=self._runtime_env,
            ).remote(self._factory_blob, self._stream_interval, self._threads)
        except Exception as e:  # noqa: BLE001 — a placement that failed is a failed load
            deliver(Loaded(None, None, e))
            return
        threading.Thread(target=self._write, daemon=True, name="inferd-ray-writer").start()
        while True:
            try:
                blobs = ray.get(self._actor.pull.remote(_PULL_WAIT_S))
            except Exception as e:  # noqa: BLE001 — RayActorError and kin: the actor is gone
                if not self._stopping:
                    deliver(Exited(f"the engine's Ray actor died ({type(e).__name__}: {e})"))
                else:
                    deliver(Exited("the server is shutting down"))
                return
            for blob in blobs:
                message = decode_message(blob)
                deliver(message)
                if isinstance(message, Exited) or (
                    isinstance(message, Loaded) and message.error is not None
                ):
                    return

    def _write(self) -> None:
        """Push commands in order: each batch waits for the last one's push to finish."""
        ray = import_ray()
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get())
            try:
                ray.get(self._actor.push.remote(cloudpickle.dumps(batch)))
            except Exception:  # noqa: BLE001 — the actor is gone; the reader reports it
                return
            if _STOP in batch:
                return

    def stop(self, timeout: float | None) -> None:
        self._stopping = True
        self._outbox.put(_STOP)
        if self._reader is not None:
            self._reader.join(timeout)
        ray = import_ray()
        if self._actor is not None:
            ray.kill(self._actor)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
        self._alive = False


def ray_backends(
    size: int,
    engine_factory: Callable[[], EngineCore],
    threads: int | None,
    address: str | None,
    stream_interval: int,
    ranks: int = 1,
    strategy: str = "STRICT_PACK",
) -> tuple[list[Callable[[], RayBackend]], list[str]]:
    """Connect to the Ray cluster at `address` and make one backend maker per replica, each a
    placement group of `ranks` (tensor-parallel) bundles of `threads` CPUs (default: the
    cluster's CPUs shared out). ValueError when Ray is missing or the cluster has too few CPUs."""
    ray = import_ray()
    try:
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    except ConnectionError as e:
        raise ValueError(f"cannot reach the Ray cluster at {address}: {e}") from None
    cpus = int(ray.cluster_resources().get("CPU", 0))
    threads = threads or max(1, cpus // (size * ranks))
    if size * ranks * threads > cpus:
        per = f" × {ranks} ranks" if ranks > 1 else ""
        raise ValueError(
            f"--data-parallel-size {size}{per} with {threads} CPU(s) each needs "
            f"{size * ranks * threads} CPUs; the Ray cluster has {cpus}"
        )
    backend = RayBackend(cloudpickle.dumps(engine_factory), threads, stream_interval,
                         runtime_env(), ranks, strategy)  # fmt: skip
    placement = f"a Ray actor with {threads} CPU{'s' if threads > 1 else ''}"
    if ranks > 1:
        placement += f" and {ranks - 1} tensor-parallel rank actor{'s' if ranks > 2 else ''}"
    return [backend.fresh] * size, [placement] * size
