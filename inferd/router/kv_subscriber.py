"""Exact mode's listener: one ZMQ SUB socket per worker that publishes KV events, each batch
handed to the policy (`on_kv_event`) on the router's event loop."""

from __future__ import annotations

import asyncio
import logging

from inferd.kv.kv_events import CLEARED, decode_batch
from inferd.router.metrics import RouterMetrics
from inferd.router.policy import RoutingPolicy
from inferd.router.workers import Worker

logger = logging.getLogger("inferd.router")


class KVEventSubscriber:
    def __init__(self, policy: RoutingPolicy, metrics: RouterMetrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self._ctx = None  # a zmq.asyncio context, made with the first subscription
        self._tasks: dict[str, asyncio.Task] = {}

    def subscribe(self, worker: Worker) -> None:
        """Listen to `worker`'s endpoint (if it has one) until `unsubscribe`."""
        if worker.kv_events_endpoint and worker.url not in self._tasks:
            self._tasks[worker.url] = asyncio.get_running_loop().create_task(self._listen(worker))

    def unsubscribe(self, worker: Worker) -> None:
        task = self._tasks.pop(worker.url, None)
        if task is not None:
            task.cancel()

    async def _listen(self, worker: Worker) -> None:
        import zmq  # only where a worker publishes events
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.instance()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(worker.kv_events_endpoint)
        except zmq.ZMQError as e:  # the approximate tree serves this worker instead
            logger.warning("KV events of %s: cannot connect to %s: %s", worker.url,
                           worker.kv_events_endpoint, e)  # fmt: skip
            sock.close()
            return
        expected: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    seq, payload = decode_batch(frames)
                except ValueError as e:
                    logger.warning("KV events from %s: %s", worker.url, e)
                    continue
                if expected is not None and seq > expected:
                    self.metrics.kv_event_gaps.labels(worker.url).inc(seq - expected)
                elif expected is not None and seq < expected and worker.healthy:
                    # The publisher started again (a restarted engine): its cache is empty.
                    self.policy.on_kv_event(worker.url, {"events": [{"type": CLEARED}]})
                expected = seq + 1
                self.metrics.kv_events.labels(worker.url).inc()
                if worker.healthy:
                    self.policy.on_kv_event(worker.url, payload)
        finally:
            sock.close()

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
