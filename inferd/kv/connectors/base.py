"""The KV connector interface: moving KV blocks out of an engine and back in (vLLM v1's split).

A connector has two sides, which talk only through the `KVConnectorMetadata` the scheduler side
builds for each step (it travels in `SchedulerOutput.kv_connector_meta`), so they may live in
different processes:

- the **scheduler side** decides: how many prompt tokens beyond the local prefix hit can come from
  outside (`get_num_new_matched_tokens`), which blocks they land in (`update_state_after_alloc`),
  what happens to a finished request's blocks (`request_finished`: keep them until an asynchronous
  send completes), and hears of the full blocks the prefix cache evicts (`blocks_evicted`);
- the **worker side** moves bytes: `start_load_kv` before the step's forward (and before any other
  write into the pool that step: the scheduler may have handed an evicted block to someone else),
  `wait_for_layer_load(layer)` before a layer reads its KV, `save_kv_layer(layer, ...)` after the
  forward wrote it, `wait_for_save()` before the step's outputs leave, and `get_finished` to report
  which asynchronous sends and receives completed.

Where the hooks sit (each called once per step, whatever the connector):

    Scheduler admission   attach_cached_prefix → get_num_new_matched_tokens → allocate_slots
                          → update_state_after_alloc           (inferd/scheduler/scheduler.py)
    Scheduler.finish      request_finished (blocks kept while a send is in flight)
    PrefixCache.evict     blocks_evicted (chained block hash, block per KV group)
    end of schedule()     build_connector_meta → SchedulerOutput.kv_connector_meta
    ModelRunner.execute   start_load_kv; wait_for_layer_load(l) for every layer; forward;
                          save_kv_layer(l) for every layer; wait_for_save
    EngineCore.step       get_finished → Scheduler.finish_kv_transfers

inferd's forward pass is one call over all layers (the CPU's fused decode step cannot stop
between layers), so the runner calls `wait_for_layer_load` for every layer before it and
`save_kv_layer` for every layer after it: loads and saves are whole-block, per step. A connector
written against the per-layer calls keeps working when the forward learns to call them between
layers.

Requests are named by their `Sequence` (scheduler side) and `seq_id` (worker side, `get_finished`):
a block table belongs to one sequence. `NullConnector` is the interface doing nothing, the engine's
connector when none is configured (so no caller checks for one).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferd.config import KVTransferConfig
    from inferd.kv.connectors.layout import KVBlockLayout
    from inferd.kv.kv_cache import KVCache, LayerKV
    from inferd.scheduler.sequence import Sequence


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step; each connector subclasses it."""


class KVConnectorBase(abc.ABC):
    """One connector; an instance may serve either side or both (one process: the engine builds
    one and hands it to the scheduler and the model runner)."""

    # True: the prefix cache computes block hashes and reports evicted full blocks (a KV tier).
    wants_evicted_blocks: bool = False
    # False: it moves one KV cache group only; the engine then keeps a sliding-window model's
    # KV in one group (as --disable-hybrid-kv-cache-manager) instead of refusing to start.
    supports_kv_groups: bool = True

    def __init__(self, config: KVTransferConfig, layout: KVBlockLayout) -> None:
        self.config = config
        self.layout = layout

    # ---- scheduler side ------------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Prompt tokens beyond the local hit `num_computed_tokens` (a whole number of blocks)
        this connector can supply: (n, load_async). n is a multiple of the block size and leaves
        at least one prompt token to compute. load_async: the KV arrives over later steps (the
        request waits until `get_finished` reports it received); False: it is in place before the
        step that schedules the request runs its forward."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Sequence, blocks: list[list[int]], num_external_tokens: int
    ) -> None:
        """The scheduler allocated the request's blocks: per KV group its whole table `blocks`;
        the external tokens land in positions [request.num_computed_tokens, + num_external_tokens)
        (request.num_computed_tokens is still the local hit here)."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's work for the worker side (loads, saves) since the last call; resets it."""

    @abc.abstractmethod
    def request_finished(
        self, request: Sequence, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (or was aborted) holding `block_ids` (per KV group). Returns
        (keep_blocks, kv_transfer_params): keep_blocks True defers freeing them until
        `get_finished` reports the request's send done; the params go back to the client."""

    def blocks_evicted(self, evicted: list[tuple[int, list[int]]]) -> None:
        """The prefix cache evicted these full blocks: (chained block hash, block id per KV group).
        Their contents stay in the pool until the next step's `start_load_kv` (nothing writes the
        pool in between); called only where `wants_evicted_blocks`."""

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        """The pool this worker's loads write into and saves read from (again after a resize)."""
        self.kv_cache = kv_cache

    @abc.abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Begin this step's transfers; runs before anything writes the pool this step."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer`'s loads for this step are in the pool."""

    def save_kv_layer(
        self, layer: int, kv_layer: tuple[LayerKV, LayerKV], meta: KVConnectorMetadata | None
    ) -> None:
        """Layer `layer`'s K/V (as the pool holds them) after this step's forward wrote them."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the pool (copied out or sent)."""

    def get_finished(self, finished_ids: Iterable[int]) -> tuple[set[int], set[int]]:
        """(seq_ids whose asynchronous send completed, seq_ids whose asynchronous load completed).
        `finished_ids`: sequences that finished this step."""
        return set(), set()

    def get_failed_loads(self) -> set[int]:
        """seq_ids whose asynchronous load failed since the last call (the sender gone, a layout
        refused): the scheduler frees their blocks and computes them itself."""
        return set()

    def remote_output_tokens(self, seq_id: int) -> list[int]:
        """Tokens another engine already sampled for a sequence whose KV just arrived (PD: the
        prefill worker's first token), appended before it runs; asked once per arrival."""
        return []

    def has_pending_sends(self) -> bool:
        """Blocks are held for an asynchronous send: the engine keeps calling `get_finished`
        while otherwise idle, so they are freed when it completes."""
        return False

    def histograms(self) -> dict[str, tuple[tuple[float, ...], list[int], float]]:
        """Histograms for /metrics (`inferd:<name>`): name → (bucket upper bounds, counts per
        bucket plus one for +Inf, sum)."""
        return {}

    # ---- both ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters for /metrics (`inferd:<name>_total`)."""
        return {}

    def shutdown(self) -> None:
        """Finish or drop what is in flight; the engine runs no more steps."""


class NullConnector(KVConnectorBase):
    """No connector: nothing is ever matched, loaded or saved."""

    def get_num_new_matched_tokens(
        self, request: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Sequence, blocks: list[list[int]], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self) -> None:
        return None

    def request_finished(self, request: Sequence, block_ids: list[list[int]]) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        return None
