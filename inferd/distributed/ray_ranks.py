"""Tensor-parallel worker ranks as Ray actors (`--tensor-parallel-size N
--distributed-executor-backend ray`): one placement group bundle per rank, rank 0 (the engine) in
bundle 0, rank r's `RankActor` in bundle r.

    engine (rank 0)                                 RankActor r (bundle r of the group)
    ---------------                                 -----------------------------------
    shard r → ray.put ─────────────────────────────► setup(weights): join the group, build
    TPGroup(0) at (this node's IP, a free port) ◄──► TPGroup(r): gloo, plus shared memory when
    broadcast each step's plan ────────────────────► every bundle is on rank 0's node
                                                     serve(): run steps until `None`

The placement group is the replica's own where the engine is itself a Ray actor placed in one with
a bundle per rank (`serve --data-parallel-size ... --distributed-executor-backend ray`); otherwise
the engine makes one, its bundle 0 pinned to this node (Ray's `node:<ip>` resource) and removed
again when the engine closes. `--ray-placement-strategy` is the group's strategy: STRICT_PACK
(the default) keeps every rank on rank 0's node, SPREAD and the others let them span nodes, where
the all-reduce goes over gloo's TCP. Ray places, starts and kills the actors (an actor dies with
the process that made it); torch.distributed does the collectives.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import inferd
from inferd import envs
from inferd.distributed.executor import START_TIMEOUT_S, RankSpec, build_worker, serve_steps
from inferd.distributed.executor import usable_cpus, worker_error

PLACEMENT_TIMEOUT_S = 120.0  # for a placement group to be placed
_CLOSE_TIMEOUT_S = 10.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--distributed-executor-backend ray needs Ray: pip install 'inferd[ray]'"
        ) from None
    return ray


def runtime_env() -> dict[str, Any]:
    """An actor's environment: this process's INFERD_* settings, and its inferd first on the path
    (where that path exists on the actor's node; elsewhere the node's own install)."""
    env = envs.settings()
    root = str(Path(inferd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": env}


def rank_bundles(tp: int, threads: int, node_ip: str | None = None) -> list[dict[str, float]]:
    """One bundle of `threads` CPUs per rank; bundle 0 (rank 0's) on the node `node_ip` names."""
    bundles = [{"CPU": float(threads)} for _ in range(tp)]
    if node_ip is not None:
        bundles[0][f"node:{node_ip}"] = 0.001
    return bundles


def wait_placed(ray: Any, group: Any, what: str) -> None:
    """Wait for `group` to be placed; RuntimeError (the group removed) when the cluster has no
    room for it within PLACEMENT_TIMEOUT_S."""
    if not group.wait(PLACEMENT_TIMEOUT_S):
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster found no room for {what} within "
                           f"{PLACEMENT_TIMEOUT_S:g} s (ray status shows its resources)")  # fmt: skip


class RankActor:
    """Worker rank `rank` inside a Ray actor: `setup`, then `serve` until rank 0 says stop."""

    def __init__(self, rank: int, spec: RankSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.rank, self.spec = rank, spec
        self.group = self.runner = None

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, weights: dict) -> str | None:
        """Join the group and build from `weights` (this rank's shard); the error as text (its
        type first, then the traceback) for rank 0 to raise, None when ready."""
        try:
            self.group, self.runner = build_worker(self.spec, self.rank, lambda: weights)
            return None
        except Exception as e:  # noqa: BLE001 (rank 0 raises it: an actor's log is easy to miss)
            return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"

    def serve(self) -> None:
        serve_steps(self.runner, self.group)


class RayRanks:
    """Ranks 1..N-1 as `RankActor`s in a placement group (the executor's `Ranks`)."""

    def __init__(self, tp: int, device: torch.device, strategy: str) -> None:
        if device.type != "cpu":
            raise ValueError("--tensor-parallel-size with --distributed-executor-backend ray runs "
                             "CPU ranks; on CUDA use the mp backend (one GPU per rank)")  # fmt: skip
        self.ray = ray = import_ray()
        from ray.util import get_current_placement_group, get_node_ip_address
        from ray.util.placement_group import placement_group, placement_group_table

        if not ray.is_initialized():  # $RAY_ADDRESS's cluster, else a local one
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self.tp, self.actors, self._setups, self._loops = tp, [], [], []
        self.host = get_node_ip_address()
        current = get_current_placement_group()
        if current is not None and current.bundle_count >= tp:
            # This engine is a replica's actor, in bundle 0 of the replica's group.
            self.group, self._owned = current, False
            self.threads = int(current.bundle_specs[0].get("CPU", 1))
        else:
            self.threads = max(1, len(usable_cpus()) // tp)
            cpus = int(ray.cluster_resources().get("CPU", 0))
            if tp * self.threads > cpus:
                raise ValueError(f"--tensor-parallel-size {tp} with {self.threads} CPU(s) per "
                                 f"rank needs {tp * self.threads} CPUs; the Ray cluster has {cpus}")  # fmt: skip
            self.group = placement_group(rank_bundles(tp, self.threads, self.host), strategy=strategy)
            self._owned = True
            wait_placed(ray, self.group, f"{tp} ranks of {self.threads} CPU(s) ({strategy})")
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        self.same_host = all(nodes[r] == here for r in range(tp))
        self._strategy = strategy

    def describe(self) -> str:
        where = "on this node" if self.same_host else "across nodes"
        return f"{self.tp - 1} Ray actor{'s' if self.tp > 2 else ''} {where}"

    def start(self, spec: RankSpec, shard: Callable[[int], dict]) -> None:
        """Start the actors, wait until each runs, and set each joining and building from its
        shard (through Ray's object store): they wait in the group for rank 0."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(RankActor)
        env = runtime_env()
        for rank in range(1, self.tp):
            self.actors.append(actor_class.options(
                num_cpus=self.threads, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, rank),
            ).remote(rank, spec))  # fmt: skip
        try:
            ray.get([a.node.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 — RayActorError, GetTimeoutError: it never ran
            raise RuntimeError(f"a tensor-parallel rank's Ray actor did not start: {e}") from None
        weights = [ray.put(shard(rank)) for rank in range(1, self.tp)]
        self._setups = [a.setup.remote(w) for a, w in zip(self.actors, weights)]

    def joined(self) -> None:
        """Nothing to hand over: each actor's shard went with its `setup`."""

    def wait_ready(self) -> None:
        try:
            errors = self.ray.get(self._setups, timeout=START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 — the actor died while building
            raise RuntimeError(f"a tensor-parallel rank's Ray actor failed: {e}") from None
        self._setups = []
        for rank, error in enumerate(errors, start=1):
            if error is not None:
                raise worker_error(rank, error)
        self._loops = [a.serve.remote() for a in self.actors]

    def alive(self) -> bool:
        """No worker's step loop has ended (an actor killed or its node lost ends it)."""
        if not self._loops:
            return True
        done, _ = self.ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        return not done

    def close(self, graceful: bool) -> None:
        """Let the step loops end (`graceful`: rank 0 broadcast `None`), then kill the actors and
        remove the placement group this engine made."""
        ray = self.ray
        if graceful and self._loops:
            ray.wait(self._loops, num_returns=len(self._loops), timeout=_CLOSE_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self._loops, self._setups = [], [], []
        if self._owned and self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.group = None
