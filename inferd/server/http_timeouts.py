"""Server-side timeouts and a connection limit, so slow or idle clients cannot hold the server.

- header timeout: from a connection's opening (or the first byte of its next request) to the end
  of the request's headers; past it the connection gets a 408 and is closed (slowloris);
- body timeout: reading a request's whole body; past it, a 408 in OpenAI's error shape;
- keep-alive timeout: an idle connection between requests is closed (uvicorn's own);
- `--limit-concurrency`: connections and tasks at once; past it uvicorn answers 503 (uvicorn's).

The header timeout lives in the HTTP protocol (the ASGI app sees a request only once its headers
are in); the body timeout is ASGI middleware.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.errors import error_body


def add_timeout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connections")
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send a request's headers (408 after)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's body (408 after)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (uvicorn's flag)",
    )
    g.add_argument("--limit-concurrency", type=int, default=2048,
                   help="connections and tasks at once before 503s (uvicorn's flag; 0: no limit)")  # fmt: skip


def _408(message: str) -> bytes:
    return json.dumps(error_body(408, message, code="request_timeout")).encode()


def protocol_class(header_timeout: float) -> Any:
    """uvicorn's httptools protocol with a header timeout ("auto" when httptools is missing)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None and header_timeout > 0:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            body = _408(f"request headers not received within {header_timeout:g} s "
                        "(--header-timeout)")  # fmt: skip
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.run` from the flags above."""
    return {
        "http": protocol_class(args.header_timeout),
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": args.limit_concurrency or None,
    }


class BodyTimeoutMiddleware:
    """A request whose body has not fully arrived within `timeout` seconds gets a 408 (the app
    sees the client as gone); after the body, `receive` passes through untouched (the app waits
    on it for disconnects for as long as a response streams)."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout <= 0:
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout
        body_done = False
        timed_out = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done or timed_out:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, timed_receive, watched_send)
        if timed_out and not started:
            body = _408(f"request body not received within {self.timeout:g} s (--body-timeout)")
            await send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
