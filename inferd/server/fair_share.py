"""A request never holds more than its share of the engine: a many-prompt /v1/completions request
feeds its prompts to the engine at most `--max-concurrent-prompts` at a time.

The first window of prompts is submitted at once (a refusal there fails the whole request, as
before); each later prompt waits for one of its own request's earlier prompts to finish, so
requests from other users that arrive meanwhile enter the engine's queue between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from inferd.engine.async_engine import RequestStream, RequestUpdate


class WindowedStream:
    """A `RequestStream` opened on first read, once its request's window has room; it gives the
    room back when it ends or is closed. Iterating and closing behave as the stream's own."""

    def __init__(
        self,
        open_stream: Callable[[], Awaitable[RequestStream]] | None,
        window: asyncio.Semaphore,
        stream: RequestStream | None = None,
    ) -> None:
        self._open = open_stream
        self._window = window
        self._stream = stream
        self._holds = stream is not None  # an already-open stream took its room at submission
        self.finished = False
        self._on_overflow: Callable[[], None] | None = None

    @property
    def on_overflow(self) -> Callable[[], None] | None:
        """The stream's backpressure hook (stream_guards.py), passed on to it once it opens."""
        return self._on_overflow

    @on_overflow.setter
    def on_overflow(self, hook: Callable[[], None] | None) -> None:
        self._on_overflow = hook
        if self._stream is not None:
            self._stream.on_overflow = hook

    def __aiter__(self) -> WindowedStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.finished:
            raise StopAsyncIteration
        if self._stream is None:
            await self._window.acquire()
            self._holds = True
            if self.finished:  # closed while waiting for room
                self._release()
                raise StopAsyncIteration
            try:
                assert self._open is not None
                self._stream = await self._open()
                self._stream.on_overflow = self._on_overflow
            except BaseException:
                self.close()
                raise
        try:
            update = await self._stream.__anext__()
        except BaseException:
            self.close()
            raise
        if update.finished:
            self.finished = True
            self._release()
        return update

    def _release(self) -> None:
        if self._holds:
            self._holds = False
            self._window.release()

    def close(self) -> None:
        """Abort the request unless it finished (or never started). Idempotent."""
        self.finished = True
        if self._stream is not None:
            self._stream.close()
        self._release()


def share_window(
    opened: list[RequestStream], later: list[Callable[[], Awaitable[RequestStream]]]
) -> list[WindowedStream]:
    """Streams for a request whose first `len(opened)` prompts are in the engine and whose
    `later` ones open, in order, each as one of the request's streams ends."""
    window = asyncio.Semaphore(0)  # every opened stream holds one unit of room until it ends
    return [WindowedStream(None, window, s) for s in opened] + [
        WindowedStream(open_stream, window) for open_stream in later
    ]
