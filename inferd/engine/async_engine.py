"""AsyncEngine: the asyncio face of the engine. It streams per-step deltas to the event loop while
the engine loop (`engine_loop.py`) runs elsewhere: in a process of its own (`inferd serve`'s
default, as vLLM V1 does; `engine_proc.py`), or on a thread of this process.

    asyncio loop                                  engine loop (its own process, or a thread)
    ------------                                  -----------
    add_request() ── AddRequest ──────────────►   EngineCore.add_request()
                  ◄─ Replies (accepted | refused)
    abort()       ── AbortRequest ────────────►   EngineCore.abort_request()  (freed before the next step)
    call(fn)      ── CallEngine ──────────────►   fn(EngineCore) between steps
    RequestStream ◄─ StepDone (deltas, timings, stats) after every step

A step never waits on a socket, and a slow client never stalls generation: its updates queue up in
its own `RequestStream`.

Thread or process: on a thread the engine shares this process's GIL with the event loop, which
holds it for a fraction of a millisecond per streamed token, often just as the engine's kernels
end; a crash of the thread takes the engine with it. A process of its own has neither problem,
but pays a pipe and a pickle per step and a spawn at start-up. With its OpenMP threads bound and
the front end on the last CPU (engine_proc.py), single-stream decode through HTTP measured 0.93-
0.95x the offline API against 0.87x on a thread. The thread stays for tests (they reach the
`EngineCore` through `AsyncEngine.engine`, e.g. to inject faults) and `--no-engine-process`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

from inferd.engine.core import EngineCore, RequestError
from inferd.engine.engine_loop import (
    AbortRequest,
    AddRequest,
    CallEngine,
    Command,
    EngineDeadError,
    EngineInfo,
    EngineLoop,
    EngineStepError,
    Exited,
    FinishedRequest,
    Loaded,
    Message,
    Replies,
    RequestUpdate,
    StepDone,
    StepReport,
)
from inferd.engine.heap import freeze_heap
from inferd.engine.stats import EngineStats
from inferd.sampling.params import SamplingParams

logger = logging.getLogger("inferd.async_engine")

T = TypeVar("T")

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineInfo",
    "EngineNotReadyError",
    "EngineStepError",
    "FinishedRequest",
    "QueueFullError",
    "RequestStream",
    "RequestUpdate",
    "StepReport",
    "StreamOverflowError",
    "ThreadBackend",
]


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); no request can be taken yet."""


class QueueFullError(RuntimeError):
    """More requests are waiting for the engine than `max_queue_len` allows."""


class StreamOverflowError(RuntimeError):
    """A streamed request's client read too slowly: more tokens waited for it than its bound."""


class EngineObserver(Protocol):
    def on_step(self, report: StepReport) -> None: ...


class EngineBackend(Protocol):
    """Where the engine loop runs. `on_message` must be called on the asyncio loop's thread."""

    core: EngineCore | None  # the EngineCore, when it lives in this process

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None: ...

    def send(self, command: Command) -> None:
        """Queue a command for the engine; thread-safe, never blocks the caller."""

    def stop(self, timeout: float | None) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    def cpu_seconds(self) -> float | None:
        """CPU time the engine has used so far (the heartbeat tells a long step from a stuck
        engine by it), or None where it cannot be read."""


# ---- the engine loop on a thread --------------------------------------------------------------


class ThreadBackend:
    """The engine loop on a thread of this process. Commands wait in an inbox the loop drains at
    the top of each iteration; messages reach the asyncio loop by `call_soon_threadsafe`."""

    def __init__(self, engine_factory: Callable[[], EngineCore], stream_interval: int = 1) -> None:
        self._factory = engine_factory
        self._stream_interval = stream_interval
        self.core: EngineCore | None = None  # read-only outside the engine thread
        self._cv = threading.Condition()  # guards the inbox; wakes the idle engine thread
        self._inbox: deque[Command] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        def deliver(message: Message) -> None:
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        self.start_delivering(deliver)

    def start_delivering(self, deliver: Callable[[Message], None]) -> None:
        """Start the engine thread; it hands each message to `deliver` (on the engine thread)."""
        self._deliver = deliver
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    def stop(self, timeout: float | None) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def cpu_seconds(self) -> float | None:
        """The engine thread's CPU time (it takes part in every parallel region of a step)."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # not on this platform, or the thread just ended
            return None

    def _take(self, timeout: float | None) -> list[Command] | None:
        with self._cv:
            if not self._inbox and not self._stopping and timeout != 0:
                self._cv.wait(timeout)
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _run(self) -> None:
        try:
            core = self._factory()
            info = EngineInfo.of(core)
        except BaseException as e:
            logger.exception("engine failed to load")
            self._deliver(Loaded(None, None, e))
            return
        self.core = core
        engine_loop = EngineLoop(core, self._deliver, self._stream_interval)
        freeze_heap()
        self._deliver(Loaded(info, engine_loop.stats))
        try:
            engine_loop.run(self._take)
        except BaseException as e:
            logger.exception("the engine loop stopped")
            self._deliver(Exited(f"the engine stopped: {type(e).__name__}: {e}"))
            raise
        self._deliver(Exited("the server is shutting down"))


# ---- the per-request stream (lives on the asyncio loop) --------------------------------------


class RequestStream:
    """Async iterator over a request's `RequestUpdate`s; raises the request's error, if any.

    Closing it before the request finished (client gone, generator closed) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        # A deque and one future, not an asyncio.Queue: this runs per streamed token, on the CPU
        # the engine's last OpenMP worker shares, and the Queue's getter bookkeeping costs more.
        self._updates: deque[RequestUpdate] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        self.scheduled = False  # set by the loop when the engine first schedules the request
        # Backpressure: tokens put but not yet taken by the consumer; above the bound the
        # request is aborted (its KV freed) and `on_overflow` runs (the server drops the client).
        self.max_buffered_tokens: int | None = None
        self.on_overflow: Callable[[], None] | None = None
        self._buffered = 0
        self._ended = False  # its last update (output or error) is in `_updates`
        self._deadline: asyncio.TimerHandle | None = None
        self.command: AddRequest | None = None  # what was submitted: another engine can retake it
        self.has_news = False  # the engine sent it something (tokens, its end, an error)

    @property
    def engine(self) -> AsyncEngine:
        """The engine that runs the request now."""
        return self._engine

    def _put(self, update: RequestUpdate) -> None:
        if self._ended:
            return  # failed here already (deadline, overflow): the engine's late news is moot
        self.has_news = True
        self._updates.append(update)
        self._ended = update.finished
        limit = self.max_buffered_tokens
        if limit is not None and not update.finished:
            self._buffered += _num_tokens(update)
            if self._buffered > limit:
                self.fail(StreamOverflowError(
                    f"the client read its stream too slowly: more than {limit} tokens waited "
                    "(--max-stream-buffer-tokens); the request was aborted"))  # fmt: skip
                self._engine._overflowed(self)
                return
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.finished:
            raise StopAsyncIteration
        updates = self._updates
        while not updates:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        update = updates.popleft()
        if self.max_buffered_tokens is not None:
            self._buffered -= _num_tokens(update)
        if update.finished:
            self.finished = True
            self._disarm()
        if update.error is not None:
            raise update.error
        return update

    def set_deadline(self, seconds: float, error: Callable[[], Exception]) -> None:
        """Fail the request with `error()` (see `fail`) unless it ends within `seconds`."""
        self._disarm()
        # Clamped: an event loop's timer takes no infinity (uvloop counts in integer ms).
        self._deadline = asyncio.get_running_loop().call_later(
            min(max(seconds, 0.0), _MAX_DELAY_S), self._expire, error
        )

    def _expire(self, error: Callable[[], Exception]) -> None:
        self._deadline = None
        if not (self.finished or self._ended):
            self.fail(error())

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent; safe from `finally`."""
        self._disarm()
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def fail(self, error: Exception) -> None:
        """End the request with `error` (a deadline, an overflow): abort it in the engine (its
        blocks free before the next step), drop what it buffered, and hand the consumer the
        error next. No-op once the request ended."""
        self._disarm()
        if self.finished or self._ended:
            return
        self._engine._forget(self)
        self._engine._backend.send(AbortRequest(self.request_id))
        self._updates.clear()
        self._buffered = 0
        self._updates.append(RequestUpdate([], time.monotonic(), error=error))
        self._ended = True
        self._wake()


_MAX_DELAY_S = 1e9  # ~31 years


def _num_tokens(update: RequestUpdate) -> int:
    return sum(len(d.new_token_ids) for d in update.deltas)


# ---- the front end ----------------------------------------------------------------------------


class AsyncEngine:
    """The asyncio face of the engine. Call `start()` from a running loop, then `add_request` /
    `generate`; `ready` turns true once the engine has loaded.

    `engine_process=True` runs the engine loop in a process of its own (then `engine_factory`
    must survive cloudpickle, and `engine` stays None); otherwise it runs on a thread.
    `bind_cpus` (with a process) binds the engine's OpenMP threads from the first core and moves
    this whole process to the last CPU: for a process that only serves HTTP (`inferd serve`).
    `stream_interval` (SGLang's `--stream-interval`): the engine loop sends a request's first
    tokens at once, then holds its news until they bring that many tokens (or the request ends).
    `make_backend`: where the engine runs, when neither a thread nor the default process (a
    replica's pinned process, a Ray actor); called again for each restart.
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineCore],
        *,
        max_queue_len: int | None = None,
        observer: EngineObserver | None = None,
        engine_process: bool = False,
        bind_cpus: bool = False,
        stream_interval: int = 1,
        max_stream_buffer_tokens: int | None = None,
        make_backend: Callable[[], EngineBackend] | None = None,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        if max_stream_buffer_tokens is not None and max_stream_buffer_tokens < 1:
            raise ValueError(
                f"max_stream_buffer_tokens must be >= 1, got {max_stream_buffer_tokens}"
            )
        self.max_queue_len = max_queue_len
        self.max_stream_buffer_tokens = max_stream_buffer_tokens
        self.observer = observer
        self.engine_process = engine_process
        self._make_backend: Callable[[], EngineBackend]
        if make_backend is not None:
            self._make_backend = make_backend
            self._backend: EngineBackend = make_backend()
        elif engine_process:
            from inferd.engine.engine_proc import ProcessBackend

            process = ProcessBackend(engine_factory, bind_cpus, stream_interval)
            self._make_backend = process.fresh
            self._backend = process
        else:
            self._make_backend = lambda: ThreadBackend(engine_factory, stream_interval)
            self._backend = self._make_backend()
        # Hooks for the server's supervisor (all on the event loop): the engine stopped; a
        # stream overflowed. `num_messages` counts what the engine sent: its heartbeat.
        self.on_exit: Callable[[str], None] | None = None
        self.on_stream_overflow: Callable[[RequestStream], None] | None = None
        # The engine died with `stream`'s request accepted and no news of it sent yet: True when
        # the hook gave it to another engine (`adopt`), so its client never learns of the death.
        self.reroute: Callable[[RequestStream], bool] | None = None
        self.num_messages = 0
        self.info: EngineInfo | None = None
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._exited: str | None = None  # why the engine stopped, once it has
        self._stats = EngineStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._streams: dict[str, RequestStream] = {}
        self._accepting: dict[str, asyncio.Future[None]] = {}  # by request id
        self._adopting: set[str] = set()  # ids in `_accepting` that came by `adopt`
        self._calls: dict[int, asyncio.Future[object]] = {}
        self._call_ids = itertools.count()
        self._num_unscheduled = 0  # submitted, not yet scheduled by the engine: the waiting queue

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._started = True
        self._backend.start(self._loop, self._on_message)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self._backend.stop(timeout)

    def restart(self) -> None:
        """Start a fresh engine after the last one stopped (the supervisor's call, on the event
        loop). Its requests have already failed (`_on_exit`); `ready` turns true once it loaded."""
        assert self._loop is not None and self._exited is not None, "the engine is running"
        self._backend.stop(1.0)  # ends the old one's writer thread and reaps its process
        self._backend = self._make_backend()
        self.info = self.load_error = None
        self._exited = None
        self._ready.clear()
        self._num_unscheduled = 0
        self._backend.start(self._loop, self._on_message)

    @property
    def has_work(self) -> bool:
        """Requests in flight or calls pending: the engine owes the front end news."""
        return bool(self._streams or self._accepting or self._calls)

    @property
    def engine(self) -> EngineCore | None:
        """The EngineCore when it runs on a thread of this process (tests inspect it), else None."""
        return self._backend.core

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.info is not None and self.is_alive

    @property
    def is_alive(self) -> bool:
        return self._started and self._exited is None and self._backend.is_alive

    def cpu_seconds(self) -> float | None:
        """CPU time the engine has used (see `EngineBackend.cpu_seconds`), or None."""
        return self._backend.cpu_seconds()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped after it had loaded (a crash, its process killed), or None."""
        if self._exited is not None:
            return self._exited
        if self._started and self.info is not None and not self._backend.is_alive:
            return "the engine is not running"
        return None

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raises the load error if loading failed."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.load_error is not None:
            raise EngineDeadError(f"engine failed to start: {self.load_error}") from self.load_error
        if self._exited is not None:
            raise EngineDeadError(self._exited)

    @property
    def stats(self) -> EngineStats:
        """The engine stats as of the end of the last loop iteration (a snapshot, never mutated)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._num_unscheduled

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished: this engine's load, as a router counts it."""
        return len(self._streams)

    # ---- requests -------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = True,
    ) -> RequestStream:
        """Submit a request and wait until the engine accepted it (a structured-output request:
        once its grammar compiled, on a worker thread of the engine). `stream=False`: the
        caller reads only the final output; the engine sends no news for it before the end.

        Raises `RequestError` (a ValueError) if the engine refuses it, `QueueFullError` if the
        waiting queue is full, `EngineNotReadyError`/`EngineDeadError` when there is no engine.
        """
        self._check_serving()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        if self.max_queue_len is not None and self._num_unscheduled >= self.max_queue_len:
            raise QueueFullError(
                f"the server is overloaded: {self._num_unscheduled} requests are waiting "
                f"(--max-queue-len {self.max_queue_len}); retry later"
            )
        assert self._loop is not None
        accepted: asyncio.Future[None] = self._loop.create_future()
        updates = RequestStream(request_id, self)
        if stream:
            updates.max_buffered_tokens = self.max_stream_buffer_tokens
        self._streams[request_id] = updates
        self._accepting[request_id] = accepted
        self._num_unscheduled += 1
        updates.command = AddRequest(
            request_id, prompt, params, priority, time.monotonic(), stream=stream
        )
        self._backend.send(updates.command)
        try:
            await accepted
        except BaseException:
            # Refused, or the caller was cancelled while waiting: forget (and abort) the request.
            if self._accepting.get(request_id) is accepted:
                del self._accepting[request_id]
            if self._streams.pop(request_id, None) is updates:
                self._mark_scheduled(updates)
            updates.finished = True
            self._backend.send(AbortRequest(request_id))
            raise
        return updates

    def adopt(self, stream: RequestStream) -> None:
        """Run `stream`'s request here after the engine that accepted it died before sending any
        news of it: the same stream object goes on, fed by this engine. A refusal here ends the
        stream with its error."""
        self._check_serving()
        command = stream.command
        assert command is not None and not stream.has_news
        rid = command.request_id
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already in use")
        assert self._loop is not None
        stream._engine = self
        stream.scheduled = False
        self._streams[rid] = stream
        self._num_unscheduled += 1
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._accepting[rid] = accepted
        self._adopting.add(rid)

        def settled(future: asyncio.Future[None]) -> None:
            self._adopting.discard(rid)
            error = None if future.cancelled() else future.exception()
            if error is not None and self._streams.get(rid) is stream:
                del self._streams[rid]
                self._mark_scheduled(stream)
                stream._put(RequestUpdate([], time.monotonic(), error=error))

        accepted.add_done_callback(settled)
        self._backend.send(command)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestUpdate]:
        """Stream a request's updates; closing the generator early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for update in stream:
                yield update
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone). Its blocks return to the pool before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            self._mark_scheduled(stream)
        self._backend.send(AbortRequest(request_id))

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._mark_scheduled(stream)

    def _overflowed(self, stream: RequestStream) -> None:
        try:
            if self.on_stream_overflow is not None:
                self.on_stream_overflow(stream)
            if stream.on_overflow is not None:
                stream.on_overflow()
        except Exception:  # a hook must never break the engine's delivery
            logger.exception("stream overflow hook failed")

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine_core)` on the engine between steps (inspection, invariants). With the
        engine in its own process, `fn` travels by cloudpickle and its result by pickle."""
        self._check_serving()
        assert self._loop is not None
        call_id = next(self._call_ids)
        done: asyncio.Future[object] = self._loop.create_future()
        self._calls[call_id] = done
        self._backend.send(CallEngine(call_id, fn))
        try:
            return await done  # type: ignore[return-value]
        finally:
            self._calls.pop(call_id, None)

    def _check_serving(self) -> None:
        if self.load_error is not None or self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason or f"the engine failed to load: {self.load_error}")
        if not self.ready:
            raise EngineNotReadyError("the model is still loading")

    def _mark_scheduled(self, stream: RequestStream) -> None:
        if not stream.scheduled:
            stream.scheduled = True
            self._num_unscheduled -= 1

    # ---- messages from the engine (asyncio loop) ------------------------------------------
    def _on_message(self, message: Message) -> None:
        self.num_messages += 1
        if isinstance(message, StepDone):
            self._deliver(message)
        elif isinstance(message, Replies):
            self._reply(message)
        elif isinstance(message, Loaded):
            self.info, self.load_error = message.info, message.error
            if message.stats is not None:
                self._stats = message.stats
            if message.info is not None and self._backend.core is None:
                freeze_heap()  # this process only serves HTTP now (the engine's process froze its own)
            self._ready.set()
        elif isinstance(message, Exited):
            self._on_exit(message.reason)

    def _deliver(self, message: StepDone) -> None:
        for rid in message.scheduled:
            stream = self._streams.get(rid)
            if stream is not None:
                self._mark_scheduled(stream)
        for rid, update in message.updates.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted by the client meanwhile
            if update.finished:
                del self._streams[rid]
                self._mark_scheduled(stream)
            stream._put(update)
        report = message.report
        if report is None:
            return
        if report.stats is not None:  # None: unchanged (the engine process sends it now and then)
            self._stats = report.stats
        if self.observer is not None:
            try:
                self.observer.on_step(report)
            except Exception:  # metrics must never break serving
                logger.exception("engine observer failed")

    def _reply(self, message: Replies) -> None:
        if message.stats is not None:
            self._stats = message.stats
        for rid, error in message.accepted:
            future = self._accepting.pop(rid, None)
            _settle(future, None, error)
        for call_id, result, error in message.calls:
            _settle(self._calls.pop(call_id, None), result, error)

    def _on_exit(self, reason: str) -> None:
        """The engine is gone: every waiting caller and open stream gets an error it can read."""
        self._exited = reason
        self._ready.set()
        error = EngineDeadError(reason)
        # Their `add_request` callers get the error (a router retries elsewhere); adopted
        # streams have readers already, and go on below like any accepted one.
        accepting = set(self._accepting) - self._adopting
        self._adopting.clear()
        for future in [*self._accepting.values(), *self._calls.values()]:
            _settle(future, None, error)
        self._accepting.clear()
        self._calls.clear()
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            if stream.request_id in accepting:
                continue
            if not stream.has_news and self.reroute is not None and self.reroute(stream):
                continue
            stream._put(RequestUpdate([], time.monotonic(), error=error))
        if self.on_exit is not None:
            self.on_exit(reason)


def _settle(future: asyncio.Future | None, result: object, error: BaseException | None) -> None:
    if future is None or future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
