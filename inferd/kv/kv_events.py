"""KV cache events: the prefix cache says which blocks it stored and evicted, a router listens.

Wire format (one ZMQ PUB message per batch, multipart as vLLM's publisher sends it):
`[topic, seq (8 bytes, big-endian), payload]`, payload a JSON object
`{"ts": unix seconds, "block_size": int, "events": [event, ...]}` with events

- `{"type": "stored", "hashes": [h, ...]}`: blocks now cached, each hash chained over its whole
  prefix (block_hash.py), listed parent first;
- `{"type": "removed", "hashes": [h, ...]}`: blocks evicted;
- `{"type": "cleared"}`: nothing is cached (sent when the publisher starts: a restarted engine
  starts empty).

`seq` counts batches from 0: a subscriber that sees a gap knows it missed some. Publishing never
blocks the engine: events go through a bounded queue to a sender thread, and when the queue is
full they are dropped and counted (`dropped`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence


logger = logging.getLogger("inferd.kv")

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


class NullKVEvents:
    """KV events off: the prefix cache computes no hashes and publishes nothing."""

    enabled = False

    def stored(self, hashes: Sequence[int]) -> None:
        pass

    def removed(self, hashes: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqKVEventPublisher:
    """Binds a ZMQ PUB socket on `endpoint` (e.g. tcp://*:5557) and sends event batches on it."""

    enabled = True

    def __init__(
        self, endpoint: str, block_size: int, topic: str = "", max_queue: int = 10_000
    ) -> None:
        import orjson  # the publisher's thread encodes; engines without events never import it
        import zmq

        self._dumps = orjson.dumps

        self.block_size = block_size
        self.topic = topic.encode()
        self.dropped = 0  # events the full queue refused
        self._queue: queue.Queue[dict | None] = queue.Queue(maxsize=max_queue)
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, max_queue)  # a slow subscriber drops, never blocks
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: cannot bind: {e}") from e
        self.endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._put({"type": CLEARED})
        self._thread = threading.Thread(target=self._send_loop, name="kv-events", daemon=True)
        self._thread.start()

    def _put(self, event: dict | None) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def stored(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._put({"type": STORED, "hashes": list(hashes)})

    def removed(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._put({"type": REMOVED, "hashes": list(hashes)})

    def _send_loop(self) -> None:
        seq = 0
        while True:
            first = self._queue.get()
            batch = [first]
            while len(batch) < 256:  # whatever else is queued goes in the same message
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events = [e for e in batch if e is not None]
            if events:
                payload = {"ts": time.time(), "block_size": self.block_size, "events": events}
                try:
                    self._socket.send_multipart(
                        [self.topic, seq.to_bytes(8, "big"), self._dumps(payload)]
                    )
                    seq += 1
                except Exception:
                    logger.debug("kv events: send failed", exc_info=True)
                    return
            if None in batch:
                return

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._socket.close()


class KVEventFormatError(ValueError):
    """A received message is not a KV event batch of this format."""


def decode_batch(frames: Sequence[bytes]) -> tuple[int, dict]:
    """(seq, payload) of one received message; KVEventFormatError (a ValueError, as is orjson's
    error for bad JSON) if it is not one of ours."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventFormatError(
            f"a KV event message has 3 frames [topic, seq, payload], got {len(frames)}"
        )
    import orjson

    payload = orjson.loads(frames[2])
    if not isinstance(payload, dict) or not isinstance(payload.get("events"), list):
        raise KVEventFormatError("a KV event payload is a JSON object with an `events` list")
    return int.from_bytes(frames[1], "big"), payload


def make_publisher(endpoint: str | None, block_size: int) -> ZmqKVEventPublisher | NullKVEvents:
    return ZmqKVEventPublisher(endpoint, block_size) if endpoint else NullKVEvents()
