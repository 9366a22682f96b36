"""Moving whole KV blocks from a prefill engine's pool into a decode engine's pool.

    decode engine (KVReceiver.pull, a worker thread)        prefill engine (KVSender, a thread)
    ─ DEALER ── {"op": "pull", transfer_id, first_block, layout, transport} ──►  ROUTER
            ◄── {"ok": true, token_ids, num_tokens, ...} + the blocks' bytes ──  (or {"ok": false, error})
    ─ DEALER ── {"op": "release", transfer_id} ──►  the sender unpins the blocks

The control channel is ZeroMQ (pyzmq) over TCP. The bytes travel one of two ways:
- "shm": the sender writes the blocks into a file in /dev/shm and names it; the receiver maps
  it, copies into its pool and unlinks it (one host; two memcpys, no socket in between);
- "tcp": the bytes ride in the reply's frames (across hosts).
NIXL and Mooncake's transfer engine are named but not driven: choosing one is a clear error.

Safety: the sender reads only blocks of a registered transfer, which the prefill engine keeps
pinned (a reference held) until the receiver releases it or its deadline passes, so no step
writes them while they are copied. The receiver writes only blocks its engine allocated to the
waiting request and does not schedule until the pull ends. A pull whose layout (layout.py)
differs from the sender's is refused with the reason, before any byte is sent.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from inferd.kv.connectors.pd.handshake import KVLayoutMismatch, check_layout, layout_json

TRANSPORTS = ("auto", "shm", "tcp", "nixl", "mooncake")
_OPTIONAL = {"nixl": "nixl", "mooncake": "mooncake"}  # transport → the module it needs


class KVTransferError(RuntimeError):
    """A pull failed (peer gone, timed out, refused); the receiver recomputes instead."""


def check_transport(name: str) -> None:
    """ValueError unless inferd can move bytes with `name`."""
    if name not in TRANSPORTS:
        raise ValueError(f"kv transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")
    module = _OPTIONAL.get(name)
    if module is None:
        return
    try:
        __import__(module)
    except ImportError:
        raise ValueError(f"kv transport {name!r} needs the {module!r} package, which is not "
                         "installed; use 'shm' (one host) or 'tcp' (any hosts)") from None  # fmt: skip
    raise ValueError(f"kv transport {name!r}: the package is installed but inferd does not drive it "
                     "yet; use 'shm' (one host) or 'tcp' (any hosts)")  # fmt: skip


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class BlockIO:
    """Whole blocks of a KVCache (inferd/kv/kv_cache.py) to and from flat tensors: the data
    [layers, planes, n, block_size, heads, head_dim] and, quantized, the scales [..., heads]."""

    def __init__(self, kv_cache) -> None:
        self.kv = kv_cache

    @property
    def pools(self) -> list[torch.Tensor]:
        return [self.kv.data] if self.kv.scales is None else [self.kv.data, self.kv.scales]

    def shapes(self, n: int) -> list[tuple[int, ...]]:
        return [(*p.shape[:2], n, *p.shape[3:]) for p in self.pools]

    def block_bytes(self) -> int:
        return sum(p[:, :, :1].numel() * p.element_size() for p in self.pools)

    def gather(
        self, blocks: Sequence[int], out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        ids = torch.tensor(list(blocks), dtype=torch.long, device=self.kv.data.device)
        if out is None:
            return [p.index_select(2, ids).cpu() for p in self.pools]
        for p, o in zip(self.pools, out):
            if p.is_cpu:
                torch.index_select(p, 2, ids, out=o)
            else:
                o.copy_(p.index_select(2, ids))
        return out

    def scatter(self, blocks: Sequence[int], parts: list[torch.Tensor]) -> None:
        ids = torch.tensor(list(blocks), dtype=torch.long, device=self.kv.data.device)
        for p, part in zip(self.pools, parts):
            p.index_copy_(2, ids, part.to(p.device))


@dataclass(slots=True)
class Outgoing:
    """A finished prefill whose blocks wait, pinned, for a decode engine to pull them."""

    token_ids: list[int]  # the prompt (K/V for positions [0, num_tokens) are in `blocks`)
    num_tokens: int
    blocks: list[int]
    extra: dict[str, Any]  # JSON-able news for the receiver (the first token)
    deadline: float  # time.monotonic() after which the blocks are freed unpulled
    busy: bool = False  # a pull is copying them now: not expired under it
    files: list[str] = field(default_factory=list)  # shm files made for it (unlinked at release)


class KVSender:
    """The prefill side: serves pulls of registered transfers on a thread of its own.
    `register` / `take_released` belong to the engine thread (which owns the blocks)."""

    def __init__(self, io: BlockIO, layout: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import zmq

        self.io = io
        self.layout = layout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.hostname = socket.gethostname()
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._released: list[str] = []  # pulled-and-released ids, for the engine thread
        self.num_sent_tokens = 0
        self.num_sent_blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="inferd-kv-sender", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------------
    def register(self, transfer_id: str, outgoing: Outgoing) -> None:
        with self._lock:
            self._transfers[transfer_id] = outgoing

    def take_released(self, now: float | None = None) -> list[tuple[str, Outgoing]]:
        """Transfers whose blocks may be freed now: released by the receiver, or past their
        deadline with no pull copying them."""
        now = time.monotonic() if now is None else now
        done: list[tuple[str, Outgoing]] = []
        with self._lock:
            for tid in [t for t, o in self._transfers.items() if o.deadline <= now and not o.busy]:
                done.append((tid, self._transfers.pop(tid)))
            for tid in self._released:
                o = self._transfers.pop(tid, None)
                if o is not None:
                    done.append((tid, o))
            self._released.clear()
        for _, o in done:
            for path in o.files:
                _unlink(path)
        return done

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)  # closes the socket even if the thread is still in a poll
        with self._lock:
            for o in self._transfers.values():
                for path in o.files:
                    _unlink(path)

    # ---- sender thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart()
            try:
                msg = orjson.loads(frames[0])
                reply = self._handle(msg)
            except Exception as e:  # noqa: BLE001 — a bad request is the peer's error, not ours
                reply = [orjson.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"})]
            if reply:
                self._sock.send_multipart([ident, *reply], copy=False)

    def _handle(self, msg: dict[str, Any]) -> list[Any]:
        op = msg.get("op")
        if op == "release":
            with self._lock:
                self._released.append(str(msg.get("transfer_id")))
            return []
        if op == "handshake":
            check_layout(self.layout, msg.get("layout"), "the puller")
            return [orjson.dumps({"ok": True, "layout": layout_json(self.layout)})]
        if op != "pull":
            raise ValueError(f"unknown op {op!r}")
        # The layout first: a mismatched receiver gets the reason and no bytes.
        check_layout(self.layout, msg.get("layout"), "the puller")
        tid = str(msg.get("transfer_id"))
        with self._lock:
            o = self._transfers.get(tid)
            if o is None:
                raise KeyError(f"no transfer {tid!r} here (never made, released, or timed out)")
            o.busy = True
        try:
            first = int(msg.get("first_block", 0))
            blocks = o.blocks[first:]
            head = {"ok": True, "token_ids": o.token_ids, "num_tokens": o.num_tokens, "extra": o.extra,
                    "first_block": first, "num_blocks": len(blocks)}  # fmt: skip
            if msg.get("transport") == "shm":
                paths, outs = [], []
                for shape, pool in zip(self.io.shapes(len(blocks)), self.io.pools):
                    path = os.path.join(_shm_dir(), f"inferd-kv-{os.getpid()}-{uuid.uuid4().hex}")
                    with open(path, "wb") as f:
                        f.truncate(_numel(shape) * pool.element_size())
                    o.files.append(path)
                    paths.append(path)
                    outs.append(
                        torch.from_file(
                            path, shared=True, size=_numel(shape), dtype=pool.dtype
                        ).view(shape)
                    )
                self.io.gather(blocks, outs)
                del outs
                head["shm"] = paths
                frames: list[Any] = [orjson.dumps(head)]
            else:
                parts = self.io.gather(blocks)
                frames = [orjson.dumps(head), *(p.numpy().data for p in parts)]
            self.num_sent_blocks += len(blocks)
            self.num_sent_tokens += max(0, o.num_tokens - first * self.layout.block_size)
            return frames
        finally:
            with self._lock:
                o.busy = False


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(slots=True)
class Pulled:
    token_ids: list[int]  # the sender's prompt
    num_tokens: int  # positions [0, num_tokens) now hold the sender's K/V
    extra: dict[str, Any]
    num_blocks: int  # blocks copied
    seconds: float


class KVReceiver:
    """The decode side: pulls a transfer's blocks into blocks its engine allocated."""

    def __init__(
        self, io: BlockIO, layout: Any, timeout_s: float = 10.0, transport: str = "auto"
    ) -> None:
        import zmq

        check_transport(transport)
        self.io = io
        self.layout = layout
        self.timeout_s = timeout_s
        self.transport = transport
        self.hostname = socket.gethostname()
        self._ctx = zmq.Context()

    def _request(self, endpoint: str, msg: dict[str, Any]) -> list[Any]:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(orjson.dumps(msg))
            if not sock.poll(int(self.timeout_s * 1000)):
                raise KVTransferError(f"{endpoint} did not answer within {self.timeout_s:g} s")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)
        head = orjson.loads(frames[0].bytes)
        if not head.get("ok"):
            error = head.get("error", "refused")
            if "KVLayoutMismatch" in error:
                raise KVLayoutMismatch(error.split(": ", 1)[-1])
            raise KVTransferError(f"{endpoint} refused: {error}")
        return [head, *frames[1:]]

    def handshake(self, endpoint: str) -> dict[str, Any]:
        """The sender's layout (JSON); KVLayoutMismatch (with the differences) if not ours."""
        head, *_ = self._request(endpoint, {"op": "handshake", "layout": layout_json(self.layout)})
        return head["layout"]

    def pull(self, handle: dict[str, Any], first_block: int, local_blocks: Sequence[int]) -> Pulled:
        """Copy the handle's blocks [first_block, ...) into `local_blocks` (one each, in order).
        KVTransferError / KVLayoutMismatch on failure; the local blocks then hold garbage."""
        start = time.perf_counter()
        endpoint = str(handle["endpoint"])
        transport = self.transport
        if transport == "auto":
            transport = "shm" if handle.get("hostname") == self.hostname else "tcp"
        msg = {"op": "pull", "transfer_id": handle["transfer_id"], "first_block": first_block,
               "layout": layout_json(self.layout), "transport": transport}  # fmt: skip
        head, *frames = self._request(endpoint, msg)
        n = int(head["num_blocks"])
        if n != len(local_blocks):
            raise KVTransferError(f"{endpoint} sent {n} blocks, {len(local_blocks)} were expected")
        shapes = self.io.shapes(n)
        if "shm" in head:
            parts = []
            try:
                for path, shape, pool in zip(head["shm"], shapes, self.io.pools):
                    parts.append(
                        torch.from_file(
                            path, shared=True, size=_numel(shape), dtype=pool.dtype
                        ).view(shape)
                    )
                self.io.scatter(local_blocks, parts)
            except (OSError, RuntimeError) as e:
                raise KVTransferError(f"shared memory from {endpoint}: {e}") from e
            finally:
                del parts
                for path in head["shm"]:
                    _unlink(path)
        else:
            parts = [torch.frombuffer(f.buffer, dtype=p.dtype).view(s)
                     for f, s, p in zip(frames, shapes, self.io.pools)]  # fmt: skip
            self.io.scatter(local_blocks, parts)
        return Pulled([int(t) for t in head["token_ids"]], int(head["num_tokens"]), head.get("extra") or {},
                      n, time.perf_counter() - start)  # fmt: skip

    def release(self, handle: dict[str, Any]) -> None:
        """Tell the sender it may free the transfer's blocks (fire and forget)."""
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # long enough to hand the message to the socket
        try:
            sock.connect(str(handle["endpoint"]))
            sock.send(orjson.dumps({"op": "release", "transfer_id": handle["transfer_id"]}))
        finally:
            sock.close()

    def close(self) -> None:
        self._ctx.destroy(linger=0)  # never waits on a socket a stuck pull still holds
