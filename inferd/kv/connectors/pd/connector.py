"""`PDConnector`: prefill/decode disaggregation behind the KV connector interface (base.py).

Roles (`--kv-role`, or vLLM's `kv_role` in `--kv-transfer-config`): a prefill worker
(kv_producer) sends, a decode worker (kv_consumer) receives, kv_both does either per request.
What a request asks for travels in its `kv_transfer_params` (the router writes them, pd.py):

- prefill side, `{"do_remote_decode": true}`: the request runs as usual (the router stops it after
  one token). When it finishes, `request_finished` pins its blocks under a transfer id on the
  `KVSender` and returns the handle {transfer_id, endpoint, hostname, num_tokens} to the client;
  the blocks are freed when the receiver releases them or `send_timeout_s` passes
  (`get_finished` reports the request's seq_id "sent").
- decode side, the handle plus `{"do_remote_prefill": true}`: at admission the prompt positions
  beyond the local prefix hit, [hit, num_tokens), are matched as external (`load_async`); once
  the scheduler allocated their blocks a worker thread pulls exactly those blocks
  (`start_load_kv`), releases the sender and reports the request received; the first token the
  prefill side sampled comes with the blocks (`remote_output_tokens`), so the request's next
  step is a decode. A pull that fails (sender gone, timed out, layouts that differ) reports the
  request failed (`get_failed_loads`): the scheduler frees its blocks and it is computed here
  from its local hit, as if no prefill had run.

One process holds both sides, so the scheduler side pins blocks on the sender directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferd.kv.connectors.base import KVConnectorBase, KVConnectorMetadata
from inferd.kv.connectors.pd.handshake import KVLayoutMismatch
from inferd.kv.connectors.pd.transport import (
    BlockIO,
    KVReceiver,
    KVSender,
    KVTransferError,
    Outgoing,
    check_transport,
)

if TYPE_CHECKING:
    from inferd.config import KVTransferConfig
    from inferd.kv.connectors.layout import KVBlockLayout
    from inferd.kv.kv_cache import KVCache
    from inferd.scheduler.sequence import Sequence

logger = logging.getLogger("inferd.kv")

# Transfer latency histogram buckets (seconds): a few blocks over shared memory to a long prompt
# over a loaded TCP link.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# kv_connector_extra_config keys and their defaults.
_EXTRA = {"kv_transport": "auto", "kv_ip": "127.0.0.1", "kv_port": 0, "send_timeout_s": 120.0,
          "pull_timeout_s": 30.0}  # fmt: skip


def pd_options(extra: dict[str, Any]) -> dict[str, Any]:
    """kv_connector_extra_config → the connector's options; ValueError naming a bad one."""
    unknown = sorted(set(extra) - set(_EXTRA))
    if unknown:
        raise ValueError(
            f"PDConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_EXTRA)}"
        )
    opts = {**_EXTRA, **extra}
    check_transport(opts["kv_transport"])
    for key in ("send_timeout_s", "pull_timeout_s"):
        if not isinstance(opts[key], (int, float)) or opts[key] <= 0:
            raise ValueError(
                f"PDConnector: {key} must be a positive number of seconds, got {opts[key]!r}"
            )
    if not isinstance(opts["kv_port"], int) or not 0 <= opts["kv_port"] < 65536:
        raise ValueError(
            f"PDConnector: kv_port must be a port number (0: any free one), got {opts['kv_port']!r}"
        )
    return opts


@dataclass(slots=True)
class _Load:
    seq_id: int
    handle: dict[str, Any]
    first_block: int  # the sender's first block to pull (the local hit's end)
    local_blocks: list[int]  # where they land, one each
    num_tokens: int  # positions [0, num_tokens) hold K/V once it lands


@dataclass(slots=True)
class PDMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


class PDConnector(KVConnectorBase):
    supports_kv_groups = False  # a sliding-window model's blocks travel as one group

    def __init__(self, config: KVTransferConfig, layout: KVBlockLayout) -> None:
        super().__init__(config, layout)
        if layout is not None and layout.num_groups != 1:
            raise ValueError("prefill/decode disaggregation needs one KV cache group: serve a "
                             "sliding-window model with --disable-hybrid-kv-cache-manager")  # fmt: skip
        self.opts = pd_options(dict(config.kv_connector_extra_config))
        self.sends = config.kv_role in ("kv_producer", "kv_both")
        self.receives = config.kv_role in ("kv_consumer", "kv_both")
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.io: BlockIO | None = None
        # Scheduler side.
        self._planned: list[_Load] = []  # since the last build_connector_meta
        self._no_load: set[int] = set()  # seq_ids whose pull failed: computed locally
        self._sending: dict[str, int] = {}  # transfer id → seq_id whose blocks it pins
        self._first_tokens: dict[int, list[int]] = {}  # seq_id → tokens the sender sampled
        # Worker side: pulls run on one thread; their outcomes wait here for get_finished.
        self._pool: ThreadPoolExecutor | None = None
        self._outcomes: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._in_flight: set[int] = set()  # seq_ids being pulled (their blocks stay until done)
        self._orphans: set[int] = set()  # finished while pulled: freed once the pull ends
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self.counters = {"kv_transfer_sent_tokens": 0, "kv_transfer_received_tokens": 0,
                         "kv_transfer_sent_blocks": 0, "kv_transfer_received_blocks": 0,
                         "kv_transfer_failures": 0, "kv_transfer_timeouts": 0}  # fmt: skip
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: +Inf
        self.latency_sum = 0.0

    # ---- worker side: the pool -------------------------------------------------------------
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        super().register_kv_cache(kv_cache)
        if self.io is None:
            self.io = BlockIO(kv_cache)
            if self.sends:
                self.sender = KVSender(
                    self.io, self.layout, self.opts["kv_ip"], self.opts["kv_port"]
                )
                logger.info("KV transfer: sending from %s", self.sender.endpoint)
            if self.receives:
                self.receiver = KVReceiver(
                    self.io, self.layout, self.opts["pull_timeout_s"], self.opts["kv_transport"]
                )
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferd-kv-pull")
        else:
            self.io.kv = kv_cache  # a resized pool (before any request runs)

    # ---- scheduler side ----------------------------------------------------------------------
    @staticmethod
    def _params(request: Sequence) -> dict[str, Any]:
        p = request.params.kv_transfer_params
        return p if isinstance(p, dict) else {}

    def get_num_new_matched_tokens(
        self, request: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        p = self._params(request)
        if not (self.receives and p.get("do_remote_prefill")) or request.seq_id in self._no_load:
            return 0, False
        # Only a request's first admission: a preempted one has output the sender never saw.
        if request.num_output_tokens or request.num_preemptions or request.index:
            return 0, False
        n = request.num_prompt_tokens
        if p.get("num_tokens") != n:  # tokenized differently there: nothing to trust
            logger.warning("KV transfer %s: the sender has %s prompt tokens, this request %d; "
                           "computing it here", p.get("transfer_id"), p.get("num_tokens"), n)  # fmt: skip
            self._no_load.add(request.seq_id)
            self.counters["kv_transfer_failures"] += 1
            return 0, False
        return n - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Sequence, blocks: list[list[int]], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        last = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._planned.append(_Load(request.seq_id, self._params(request), first, list(blocks[0][first:last]),
                                   request.num_computed_tokens + num_external_tokens))  # fmt: skip

    def build_connector_meta(self) -> PDMetadata | None:
        if not self._planned:
            return None
        meta, self._planned = PDMetadata(self._planned), []
        return meta

    def request_finished(
        self, request: Sequence, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        if request.seq_id in self._in_flight:  # aborted while its blocks are being written
            self._orphans.add(request.seq_id)
            return True, None
        self._no_load.discard(request.seq_id)
        self._first_tokens.pop(request.seq_id, None)
        p = self._params(request)
        if not (self.sends and p.get("do_remote_decode")) or request.finish_reason in (
            "abort",
            "error",
        ):
            return False, None
        if self.sender is None or not block_ids or request.num_output_tokens < 1:
            return False, None
        n = request.num_prompt_tokens  # K/V computed for [0, n); the first token is not yet
        blocks = block_ids[0][: -(-n // self.layout.block_size)]
        tid = uuid.uuid4().hex
        first = request.token_ids[n : n + 1]
        self.sender.register(tid, Outgoing(request.token_ids[:n], n, blocks, {"output_token_ids": first},
                                           time.monotonic() + self.opts["send_timeout_s"]))  # fmt: skip
        self._sending[tid] = request.seq_id
        handle = {"transfer_id": tid, "endpoint": self.sender.endpoint, "hostname": self.sender.hostname,
                  "num_tokens": n}  # fmt: skip
        return True, handle

    def remote_output_tokens(self, seq_id: int) -> list[int]:
        """Tokens the sender sampled for a request whose KV arrived (its first token)."""
        return self._first_tokens.pop(seq_id, [])

    # ---- worker side: transfers ----------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, PDMetadata):
            return
        for load in meta.loads:
            self._in_flight.add(load.seq_id)
            self._pool.submit(self._pull, load)

    def _pull(self, load: _Load) -> None:
        """On the pull thread: copy the blocks in, release the sender, report the outcome."""
        try:
            got = self.receiver.pull(load.handle, load.first_block, load.local_blocks)
            if (
                got.num_tokens != load.num_tokens
                or len(got.extra.get("output_token_ids") or ()) != 1
            ):
                raise KVTransferError(
                    f"the sender holds {got.num_tokens} tokens, {load.num_tokens} expected"
                )
            outcome: Any = got
        except (KVTransferError, KVLayoutMismatch, OSError, ValueError, KeyError) as e:
            outcome = e
        except Exception as e:
            logger.exception("KV pull failed")
            outcome = e
        if not isinstance(outcome, KVTransferError) or "did not answer" not in str(outcome):
            try:
                self.receiver.release(load.handle)  # the sender may free its blocks now
            except Exception:
                logger.debug("release of %s failed", load.handle.get("transfer_id"), exc_info=True)
        self._outcomes.put((load.seq_id, (load, outcome)))

    def get_finished(self, finished_ids: Iterable[int]) -> tuple[set[int], set[int]]:
        sent: set[int] = set()
        received: set[int] = set()
        if self.sender is not None:
            released = self.sender.take_released()
            for tid, o in released:
                seq_id = self._sending.pop(tid, None)
                if seq_id is not None:
                    sent.add(seq_id)
            self.counters["kv_transfer_sent_tokens"] = self.sender.num_sent_tokens
            self.counters["kv_transfer_sent_blocks"] = self.sender.num_sent_blocks
        while True:
            try:
                seq_id, (load, outcome) = self._outcomes.get_nowait()
            except queue.Empty:
                break
            self._in_flight.discard(seq_id)
            if seq_id in self._orphans:  # its request is gone: the blocks may go too
                self._orphans.discard(seq_id)
                sent.add(seq_id)
                continue
            if isinstance(outcome, Exception):
                logger.warning("KV transfer %s failed (%s: %s); computing the prompt here",
                               load.handle.get("transfer_id"), type(outcome).__name__, outcome)  # fmt: skip
                self.counters["kv_transfer_failures"] += 1
                if "did not answer" in str(outcome):
                    self.counters["kv_transfer_timeouts"] += 1
                self._no_load.add(seq_id)
                self._failed.add(seq_id)
                continue
            bs = self.layout.block_size
            self.counters["kv_transfer_received_tokens"] += load.num_tokens - load.first_block * bs
            self.counters["kv_transfer_received_blocks"] += outcome.num_blocks
            self._observe(outcome.seconds)
            self._first_tokens[seq_id] = [int(t) for t in outcome.extra["output_token_ids"]]
            received.add(seq_id)
        return sent, received

    def get_failed_loads(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def has_pending_sends(self) -> bool:
        return bool(self._sending) or bool(self._in_flight)

    def _observe(self, seconds: float) -> None:
        self.latency_sum += seconds
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.latency_counts[i] += 1

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def histograms(self) -> dict[str, tuple[tuple[float, ...], list[int], float]]:
        if not self.receives:
            return {}
        return {
            "kv_transfer_latency_seconds": (
                LATENCY_BUCKETS,
                list(self.latency_counts),
                self.latency_sum,
            )
        }

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # a stuck pull must not hold up the exit
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
