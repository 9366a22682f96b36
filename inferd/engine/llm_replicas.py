"""`LLM(model, data_parallel_size=N)`: N engine replicas for the offline API, each an `EngineCore`
in a spawned process of its own, pinned to its share of the cores (replica i of N: cores
[i*C/N, (i+1)*C/N), one torch thread per core).

    generate(prompts) ─► replica 0 validates every prompt (token ids, or the first error: nothing
                         runs when one prompt is invalid)
                      ─► the cache-aware policy (inferd/router/policy.py) picks each prompt's
                         replica by its token ids and the prompts given each replica so far
                      ─► every replica runs its share at once; the outputs come back in prompt order

The policy remembers what it sent where, so a later call's prompts that share a prefix with an
earlier one's go to the replica whose prefix cache holds it, unless that would unbalance the
replicas. A replica that dies fails the call (RuntimeError). `close()` stops the replicas (each
leaves its loop and closes its engine); dropping the pool or leaving the interpreter does too, and
a replica whose parent died exits by itself.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import weakref
from typing import Any

import torch
from tqdm import tqdm

from inferd.config import EngineConfig
from inferd.distributed.cpus import split_cpus
from inferd.distributed.executor import usable_cpus
from inferd.distributed.mp_ranks import exit_with_parent
from inferd.engine.outputs import RequestOutput
from inferd.engine.stats import EngineStats
from inferd.loader import Tokenizer, load_tokenizer
from inferd.router.policy import make_policy
from inferd.sampling.params import SamplingParams

_START_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 30.0


def _replica_main(index: int, config: EngineConfig, cpus: list[int], verbose: bool, conn) -> None:
    """One replica: build the engine, then answer commands until `stop` (or the pipe closes)."""
    from inferd.engine.core import EngineCore
    from inferd.engine.llm import run_prompts, validate_prompts

    exit_with_parent()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    try:
        engine = EngineCore(config, verbose=verbose and index == 0)
    except Exception as e:  # noqa: BLE001 — the caller raises it
        conn.send(("error", (type(e).__name__, str(e))))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:  # the caller is gone
                return
            if command == "stop":
                return
            try:
                if command == "validate":
                    result: Any = validate_prompts(engine, *args)
                elif command == "run":
                    result = run_prompts(engine, *args, use_tqdm=False)
                elif command == "reset_prefix_cache":
                    result = engine.reset_prefix_cache()
                else:  # "stats"
                    result = engine.get_stats()
                conn.send(("ok", result))
            except Exception as e:  # noqa: BLE001 — the caller raises it; the replica serves on
                conn.send(("error", (type(e).__name__, str(e))))
    finally:
        engine.close()


def _stop(processes: list, conns: list) -> None:
    """Ask each replica to stop, wait for it, terminate it if it does not (idempotent)."""
    for conn in conns:
        try:
            conn.send(("stop", None))
        except (OSError, ValueError):  # already gone
            pass
    for p in processes:
        p.join(_STOP_TIMEOUT_S)
        if p.is_alive():
            p.terminate()
            p.join(5)
    for conn in conns:
        conn.close()
    processes.clear()
    conns.clear()


class ReplicaPool:
    """N engine replicas in processes of their own, and the policy that splits prompts."""

    def __init__(self, config: EngineConfig, size: int, *, verbose: bool = True) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {size}")
        shares = split_cpus(usable_cpus(), size)
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self.size = size
        self.policy = make_policy("cache_aware")
        self.workers = [str(i) for i in range(size)]
        for w in self.workers:
            self.policy.add_worker(w)
        ctx = multiprocessing.get_context("spawn")
        self._processes: list = []
        self._conns: list = []
        # Stops the replicas when the pool is dropped or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._conns)
        try:
            for i, cpus in enumerate(shares):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_replica_main, args=(i, config, cpus, verbose, child),
                                daemon=True, name=f"inferd-replica{i}")  # fmt: skip
                p.start()
                child.close()
                self._processes.append(p)
                self._conns.append(parent)
            for i in range(size):
                self._reply(i, _START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _reply(self, i: int, timeout: float | None = None) -> Any:
        """Replica i's answer to its last command; its error raised here."""
        conn, p = self._conns[i], self._processes[i]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not p.is_alive():
                raise RuntimeError(f"engine replica {i} exited (code {p.exitcode})")
            if timeout is not None and waited > timeout:
                raise RuntimeError(f"engine replica {i} did not answer within {timeout:g} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"engine replica {i} exited") from None
        if kind == "error":
            name, message = value
            raise (ValueError if name in ("ValueError", "ModelLoadError") else RuntimeError)(
                f"engine replica {i}: {name}: {message}" if name != "ValueError" else message
            )
        return value

    def _all(self, command: str, args: tuple = ()) -> list[Any]:
        for conn in self._conns:
            conn.send((command, args))
        return [self._reply(i) for i in range(self.size)]

    def generate(
        self,
        ids: list[str],
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Validate on replica 0, route each prompt, run every share at once; in prompt order."""
        if not self._conns:
            raise RuntimeError("the LLM is closed")
        self._conns[0].send(("validate", (prompts, params)))
        token_ids: list[list[int]] = self._reply(0)
        shares: dict[str, list[int]] = {w: [] for w in self.workers}
        for i, toks in enumerate(token_ids):
            loads = {w: len(s) for w, s in shares.items()}
            shares[self.policy.select(toks, loads)].append(i)
        busy = [(int(w), s) for w, s in shares.items() if s]
        for r, share in busy:
            pick = lambda xs: [xs[i] for i in share]  # noqa: E731
            args = (pick(ids), pick(prompts), pick(token_ids), pick(params), pick(priorities))
            self._conns[r].send(("run", args))
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
            for r, share in busy:
                for out in self._reply(r):
                    outputs[out.request_id] = out
                bar.update(len(share))
        return [outputs[rid] for rid in ids]

    def reset_prefix_cache(self) -> bool:
        return all(self._all("reset_prefix_cache"))

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own stats, in replica order."""
        return self._all("stats")

    def get_stats(self) -> EngineStats:
        """The replicas' counters summed; the KV usage over all their blocks."""
        stats = self.replica_stats()
        total = dataclasses.replace(stats[0])
        for f in dataclasses.fields(EngineStats):
            values = [getattr(s, f.name) for s in stats]
            if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
                setattr(total, f.name, sum(values))
        blocks = total.num_total_blocks
        used = sum(s.kv_cache_usage * s.num_total_blocks for s in stats)
        total.kv_cache_usage = used / blocks if blocks else 0.0
        return total

    @property
    def pids(self) -> list[int]:
        """The replicas' process ids (tests check that they exit)."""
        return [p.pid for p in self._processes]

    def close(self) -> None:
        """Stop every replica (idempotent)."""
        self._finalizer()
