"""Guards on a request's life in the front end: its `timeout` (a deadline that aborts it and frees
its KV) and its stream's bound (a client that stops reading is dropped, not buffered for).

Backpressure, end to end: a client that stops reading fills its socket buffers, then uvicorn's
transport passes its high-water mark and `send` waits; the SSE body stops taking updates, and the
engine's news piles up in the request's `RequestStream`. Past `--max-stream-buffer-tokens` tokens
the stream fails itself (the engine aborts the request and frees its blocks before the next step)
and the connection is aborted here: a graceful close would wait forever to flush to a client that
never reads. uvicorn does not hand the ASGI app its transport, so `http_protocol()` is uvicorn's
httptools protocol (as `inferd serve` configures it) with the transport put in the scope's
extensions (`with_transport_in_scope`); without it (h11) the response's task is cancelled, and
uvicorn closes the connection itself.

The same protocol caps each connection's kernel send buffer at `SOCKET_SEND_BUFFER`: Linux grows
it up to `tcp_wmem`'s maximum (4 MiB here, ~20k streamed tokens) for a client that stops reading,
which is kernel memory per idle reader and a long delay before the bound above is ever reached.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Scope

from inferd.engine.async_engine import RequestStream
from inferd.server.errors import APIError

TRANSPORT_EXTENSION = "inferd.transport"
SOCKET_SEND_BUFFER = 128 << 10  # bytes; plenty for token streams and large JSON bodies alike


class RequestTimeoutError(APIError):
    def __init__(self, timeout: float) -> None:
        super().__init__(
            408,
            f"the request did not finish within its timeout of {timeout:g} s; it was aborted",
            param="timeout",
            code="request_timeout",
        )


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise APIError(400, f"timeout must be > 0 seconds, got {timeout}", param="timeout")


class Deadline:
    """A request's `timeout`: each of its streams, armed when the engine accepts it, fails with
    a 408 `request_timeout` unless it ends `timeout` seconds after this was made (the request's
    arrival, near enough). `on_timeout` counts each request that hit it, once."""

    def __init__(self, timeout: float | None, on_timeout: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.started = time.monotonic()
        self._on_timeout = on_timeout

    def arm(self, stream: RequestStream) -> None:
        if self.timeout is not None:
            stream.set_deadline(self.timeout - (time.monotonic() - self.started), self._error)

    def _error(self) -> Exception:
        assert self.timeout is not None
        if self._on_timeout is not None:
            self._on_timeout()
            self._on_timeout = None
        return RequestTimeoutError(self.timeout)


def drop_client_on_overflow(scope: Scope, streams: list[RequestStream]) -> None:
    """When one of `streams` overflows, abort the connection it streams to."""
    transport = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION)
    task = asyncio.current_task()

    def drop() -> None:
        if transport is not None:
            transport.abort()
        elif task is not None:
            task.cancel()

    for stream in streams:
        stream.on_overflow = drop


def with_transport_in_scope(options: dict[str, Any]) -> dict[str, Any]:
    """`uvicorn.run` options whose HTTP protocol also tells the app its transport and caps each
    connection's send buffer: a subclass of the `http` protocol class the options name (or of
    uvicorn's httptools protocol for "auto"/"httptools"); h11 is left as it is."""
    base = options.get("http", "auto")
    if isinstance(base, str):
        if base not in ("auto", "httptools"):
            return options
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            return options
        base = HttpToolsProtocol

    class TransportInScope(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
                except OSError:
                    pass  # not a TCP socket (a Unix socket may refuse): leave it as it is
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            extensions = dict(self.scope.get("extensions") or {})
            extensions[TRANSPORT_EXTENSION] = self.transport
            self.scope["extensions"] = extensions

    return {**options, "http": TransportInScope}
