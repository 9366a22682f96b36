"""ASGI middleware that guards the door: the API key and the request body size limit.

Both run before FastAPI parses anything, so an unauthenticated or oversized request costs no JSON
parsing and no engine work. Written as plain ASGI (not `BaseHTTPMiddleware`) so streaming responses
and client-disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.errors import error_body

# Paths anyone may call even when --api-key is set: probes, scrapers and the API description.
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}
)


async def _send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every path except `OPEN_PATHS` (401 otherwise); `api_key`:
    one key or several (tenants, the admin key)."""

    def __init__(self, app: ASGIApp, api_key: str | list[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else api_key
        self.expected = [f"Bearer {k}".encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # Constant-time comparison: the key must not leak through response timing.
        # Every key compared (a list, not a generator): the time does not tell which one matched.
        if not any([hmac.compare_digest(given, key) for key in self.expected]):  # noqa: C419
            message = "missing API key" if not given else "incorrect API key provided"
            await _send_error(
                send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")]
            )
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a body over `max_bytes` with 413 before the app reads it.

    A declared Content-Length over the limit is refused at once; a chunked body is read here up to
    the limit (the API's bodies are small JSON documents the app would buffer anyway) and then
    replayed to the app, so an endless body never reaches the JSON parser.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _send_error(send, 400, "invalid Content-Length header", "invalid_header")
                return
            if declared > self.max_bytes:
                await self._too_large(send, declared)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replayed() -> Message:
            # The body once, then the real channel (the app listens on it for client disconnects).
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "over the limit"
        await _send_error(
            send,
            413,
            f"request body is {size}; the limit is {self.max_bytes} bytes (--max-request-bytes)",
            "request_too_large",
        )
