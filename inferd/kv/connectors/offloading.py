"""The KV tier below memory (`--kv-offload-dir`, `--kv-offload-size`, `--kv-offload-cpu`): full
blocks the prefix cache evicts are kept in host memory and on disk, and a later prompt whose
prefix misses memory but hits the tier loads them instead of recomputing them.

- Save: the prefix cache reports each evicted block (`blocks_evicted`); the next step's
  `start_load_kv` copies their KV out of the pool before anything can overwrite them (one gather,
  every layer, K and V, scales of an int8/fp8 cache), puts them in the host tier and queues them
  for a writer thread, which writes the files. The queue is bounded: when it is full the write is
  dropped (and counted), never waited for. A block whose file exists is only touched.
- Load: `get_num_new_matched_tokens` walks the prompt's block hashes past the local hit, stopping
  at the first block neither the host tier holds nor a file names. When every block found is in
  host memory the load is synchronous: `update_state_after_alloc` pairs them with the blocks the
  scheduler allocated and the step's `start_load_kv` scatters them into the pool before its
  forward. When a file is involved it is asynchronous (load_async True): the request waits outside
  the queue holding its blocks while a loader thread reads each file (verified: checksum, layout,
  hash) and scatters it in, so the engine's other requests keep stepping meanwhile; `get_finished`
  reports it done. A file that fails verification fails the load: the scheduler frees the blocks
  and admits the request again, and that file no longer counts (the blocks before it load, the
  rest are computed). The prefix cache takes loaded blocks like computed ones.

Only leaves evicted whole with a block in every KV group are kept (a sliding-window group's blocks
are often given back before that, so hybrid models keep less). Not with tensor parallelism.
Loads are whole blocks, every layer at once: on the CPU the forward and a copy share the same
cores and memory bandwidth, so layer-by-layer overlap would buy little.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from inferd.config import KVTransferConfig
from inferd.kv.block_hash import chain_hashes
from inferd.kv.connectors.base import KVConnectorBase, KVConnectorMetadata
from inferd.kv.connectors.layout import KVBlockLayout
from inferd.kv.connectors.store import BlockKV, DiskStore, HostStore

logger = logging.getLogger("inferd.kv.tier")

# Blocks waiting for the writer thread; past it, writes are dropped.
WRITE_QUEUE_BLOCKS = 1024


@dataclass(slots=True)
class _Load:
    """An asynchronous load: per block position, its block per group and where its KV is (the
    host tier's copy, else the block hash to read from its file)."""

    seq_id: int
    blocks: list[tuple[list[int], BlockKV | int]]


@dataclass(slots=True)
class TierMetadata(KVConnectorMetadata):
    saves: list[tuple[int, list[int]]] = field(default_factory=list)  # (hash, block per group)
    loads: list[tuple[list[int], BlockKV]] = field(default_factory=list)  # (block per group, KV)
    async_loads: list[_Load] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase):
    wants_evicted_blocks = True

    def __init__(self, config: KVTransferConfig, layout: KVBlockLayout) -> None:
        super().__init__(config, layout)
        self.host = HostStore(config.kv_offload_cpu) if config.kv_offload_cpu > 0 else None
        self.disk = (DiskStore(config.kv_offload_dir, config.kv_offload_size, layout)
                     if config.kv_offload_dir is not None else None)  # fmt: skip
        self.hits_tokens = 0
        self.dropped_writes = 0
        self._saves: list[tuple[int, list[int]]] = []
        self._loads: list[tuple[list[int], BlockKV]] = []
        self._async_loads: list[_Load] = []
        # seq_id → the blocks found past its local hit: the host tier's copy, else the hash of
        # a file to read
        self._staged: dict[int, list[BlockKV | int]] = {}
        # Asynchronous loads (worker side): one loader thread; outcomes wait for get_finished.
        self._loader: queue.Queue[_Load | None] = queue.Queue()
        self._loader_thread: threading.Thread | None = None
        self._in_flight: set[int] = set()
        self._orphans: set[int] = set()  # finished while loading: freed once the load ends
        # (seq_id, blocks loaded; 0: failed), put by the loader, taken on the engine's thread
        self._outcomes: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._failed: set[int] = set()
        self._queue: queue.Queue[tuple[int, BlockKV] | threading.Event | None] = queue.Queue(
            WRITE_QUEUE_BLOCKS
        )
        self._writer: threading.Thread | None = None
        if self.disk is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="inferd-kv-tier-writer", daemon=True
            )
            self._writer.start()
            logger.info("KV tier: %s (%d files, %.1f of %.1f MiB), blocks of %s", self.disk.dir,
                        len(self.disk._index), self.disk.nbytes / 2**20, self.disk.size_limit / 2**20,
                        layout.describe())  # fmt: skip

    # ---- scheduler side ------------------------------------------------------------------------
    def _read(self, block_hash: int) -> BlockKV | None:
        """The block's KV from its file (verified), kept in the host tier too; None if unsound."""
        block = self.disk.read(block_hash) if self.disk is not None else None
        if block is not None and self.host is not None:
            self.host.put(self.layout.block_key(block_hash), block)
        return block

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.layout.block_size
        tokens = request.token_ids
        last = (len(tokens) - 1) // bs  # at least one token is left to compute
        first = num_computed_tokens // bs
        self._staged.pop(request.seq_id, None)
        if first >= last:
            return 0, False
        hashes = chain_hashes(tokens[: last * bs], bs, request.params.cache_salt)
        found: list[BlockKV | int] = []
        for h in hashes[first:]:
            key = self.layout.block_key(h)
            block = self.host.get(key) if self.host is not None else None
            if block is not None:
                found.append(block)
            elif self.disk is not None and self.disk.holds(h):
                found.append(h)  # read on the loader thread
            else:
                break
        if found:
            self._staged[request.seq_id] = found
        return len(found) * bs, any(isinstance(b, int) for b in found)

    def update_state_after_alloc(
        self, request, blocks: list[list[int]], num_external_tokens: int
    ) -> None:
        staged = self._staged.pop(request.seq_id, [])
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        count = num_external_tokens // bs
        assert count <= len(staged), "more external tokens than blocks found"
        placed = [([table[first + j] for table in blocks], staged[j]) for j in range(count)]
        if any(isinstance(kv, int) for _, kv in placed):
            self._async_loads.append(_Load(request.seq_id, placed))
            return  # counted as hits once loaded
        self._loads.extend(placed)  # type: ignore[arg-type]  # every one a BlockKV here
        self.hits_tokens += count * bs

    def build_connector_meta(self) -> TierMetadata | None:
        if not self._saves and not self._loads and not self._async_loads:
            return None
        meta = TierMetadata(self._saves, self._loads, self._async_loads)
        self._saves, self._loads, self._async_loads = [], [], []
        return meta

    def request_finished(self, request, block_ids: list[list[int]]) -> tuple[bool, None]:
        self._staged.pop(request.seq_id, None)
        if request.seq_id in self._in_flight:  # aborted while the loader writes its blocks
            self._orphans.add(request.seq_id)
            return True, None
        return False, None

    def blocks_evicted(self, evicted: list[tuple[int, list[int]]]) -> None:
        self._saves.extend(evicted)

    # ---- worker side ---------------------------------------------------------------------------
    def start_load_kv(self, meta: TierMetadata | None) -> None:
        if meta is None:
            return
        if meta.saves:  # first: a block evicted this step may be one a load below writes
            self._save([h for h, _ in meta.saves], [b for _, blocks in meta.saves for b in blocks])
        if meta.loads:
            self._load(
                [b for blocks, _ in meta.loads for b in blocks], [kv for _, kv in meta.loads]
            )
        for load in meta.async_loads:  # after the saves: their blocks may be among its targets
            if self._loader_thread is None:
                self._loader_thread = threading.Thread(
                    target=self._load_loop, name="inferd-kv-tier-loader", daemon=True
                )
                self._loader_thread.start()
            self._in_flight.add(load.seq_id)
            self._loader.put(load)

    def _load_loop(self) -> None:
        """The loader thread: read each load's files, scatter them into the pool, report."""
        while True:
            load = self._loader.get()
            if load is None:
                return
            loaded = 0
            try:
                blocks = [kv if isinstance(kv, BlockKV) else self._read(kv) for _, kv in load.blocks]
                if all(b is not None for b in blocks):
                    self._load([b for ids, _ in load.blocks for b in ids], blocks)  # type: ignore[arg-type]
                    loaded = len(blocks)
            except Exception:
                logger.exception("KV tier: loading blocks failed; they are computed instead")
            self._outcomes.put((load.seq_id, loaded))

    def get_finished(self, finished_ids) -> tuple[set[int], set[int]]:
        freed: set[int] = set()
        loaded: set[int] = set()
        while True:
            try:
                seq_id, num_blocks = self._outcomes.get_nowait()
            except queue.Empty:
                break
            self._in_flight.discard(seq_id)
            if seq_id in self._orphans:  # its request is gone: the blocks may go too
                self._orphans.discard(seq_id)
                freed.add(seq_id)
            elif num_blocks:
                loaded.add(seq_id)
                self.hits_tokens += num_blocks * self.layout.block_size
            else:
                self._failed.add(seq_id)
        return freed, loaded

    def get_failed_loads(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def has_pending_sends(self) -> bool:
        return bool(self._in_flight)

    def _save(self, hashes: list[int], block_ids: list[int]) -> None:
        lay, kv = self.layout, self.kv_cache
        n, ng = len(hashes), lay.num_groups
        idx = torch.tensor(block_ids, device=kv.data.device)

        def gather(
            t: torch.Tensor,
        ) -> torch.Tensor:  # → [n, groups, layers, planes, bs, ...] on the host
            sel = t.index_select(2, idx)  # [layers, planes, n * groups, bs, ...]
            return _swap_pairs(sel.view(*sel.shape[:2], n, ng, *sel.shape[3:])).contiguous().cpu()

        data = gather(kv.data)
        scales = gather(kv.scales) if kv.scales is not None else None
        for i, h in enumerate(hashes):
            block = BlockKV(data[i], scales[i] if scales is not None else None)
            if self.host is not None:
                self.host.put(lay.block_key(h), BlockKV(block.data.clone(), None if block.scales is None
                                                        else block.scales.clone()))  # fmt: skip
            if self.disk is not None:
                try:
                    self._queue.put_nowait((h, block))
                except queue.Full:
                    self.dropped_writes += 1

    def _load(self, block_ids: list[int], blocks: list[BlockKV]) -> None:
        kv = self.kv_cache
        idx = torch.tensor(block_ids, device=kv.data.device)

        data = torch.stack([b.data for b in blocks]).to(kv.data.device)  # [n, g, L, P, bs, h, d]
        kv.data.index_copy_(2, idx, _to_pool(data))
        if kv.scales is not None:
            scales = torch.stack([b.scales for b in blocks]).to(kv.data.device)
            kv.scales.index_copy_(2, idx, _to_pool(scales))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # `flush`: everything before it is written
                item.set()
                continue
            try:
                self.disk.write(*item)
            except Exception:
                logger.exception("KV tier: writing a block failed")

    # ---- both ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        disk, host = self.disk, self.host
        return {
            "kv_offload_hits": self.hits_tokens,
            "kv_offload_bytes_written": disk.bytes_written if disk else 0,
            "kv_offload_bytes_read": disk.bytes_read if disk else 0,
            "kv_offload_evictions": (disk.evictions if disk else 0)
            + (host.evictions if host else 0),
            "kv_offload_dropped_writes": self.dropped_writes,
            "kv_offload_rejected_files": disk.rejected if disk else 0,
        }

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the writer has written everything queued so far (tests, shutdown)."""
        if self._writer is None:
            return
        done = threading.Event()
        self._queue.put(done, timeout=timeout)  # type: ignore[arg-type]
        done.wait(timeout)

    def shutdown(self) -> None:
        if self._loader_thread is not None and self._loader_thread.is_alive():
            self._loader.put(None)
            self._loader_thread.join(30.0)
        if self._writer is not None and self._writer.is_alive():
            try:
                self._queue.put(None, timeout=30.0)
            except queue.Full:
                pass
            self._writer.join(30.0)
            if self._writer.is_alive():
                logger.warning(
                    "KV tier: the writer did not finish in 30 s; unwritten blocks are lost"
                )


def _swap_pairs(t: torch.Tensor) -> torch.Tensor:
    """[a, b, c, d, ...] → [c, d, a, b, ...] (its own inverse): the pool's [layers, planes, n,
    groups, ...] ↔ the tier's [n, groups, layers, planes, ...]."""
    return t.permute(2, 3, 0, 1, *range(4, t.dim()))


def _to_pool(t: torch.Tensor) -> torch.Tensor:
    """[n, groups, layers, planes, bs, ...] → the pool's [layers, planes, n * groups, bs, ...]."""
    t = _swap_pairs(t)
    return t.reshape(*t.shape[:2], -1, *t.shape[4:])
