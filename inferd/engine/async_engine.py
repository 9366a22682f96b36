"""AsyncEngine: runs `EngineCore` in its own thread and streams per-step deltas to an asyncio loop.

Contract: `EngineCore` is not thread-safe, so *every* call into it (construction included) happens
on the engine thread. The asyncio side only puts commands (add, abort) on a thread-safe inbox, which
the thread drains at the top of each loop iteration, and receives one batch of updates per step via
`loop.call_soon_threadsafe`. A step therefore never waits on a socket, and a slow client never
stalls generation: its updates simply queue up in its own `RequestStream`.

    asyncio loop                         engine thread
    ------------                         -------------
    add_request() ── _Add ──► inbox ──►  EngineCore.add_request()  (RequestError → future)
    abort()       ── _Abort ─► inbox ──► EngineCore.abort_request()  (blocks freed before next step)
    RequestStream ◄── StepBatch ◄─────── EngineCore.step(), pop_finished(), timings, stats
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from inferd.engine.core import EngineCore, RequestError
from inferd.engine.outputs import RequestOutput, SequenceDelta
from inferd.engine.stats import EngineStats
from inferd.sampling.params import SamplingParams
from inferd.scheduler.sequence import SequenceStatus

logger = logging.getLogger("inferd.async_engine")

T = TypeVar("T")


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); no request can be taken yet."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; the server cannot serve any more requests."""


class EngineStepError(RuntimeError):
    """`EngineCore.step()` raised while this request was in flight; the request was aborted."""


class QueueFullError(RuntimeError):
    """More requests are waiting for the engine than `max_queue_len` allows."""


# ---- records crossing the thread boundary (immutable once posted) ---------------------------


@dataclass(slots=True)
class RequestUpdate:
    """One step's news about one request: its deltas, and on the last update its final output."""

    deltas: list[SequenceDelta]
    time: float  # time.monotonic() at the end of the step
    output: RequestOutput | None = None  # set once: the request is finished (or aborted)
    error: Exception | None = None  # set once: the request failed; no more updates follow

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None


@dataclass(slots=True)
class FinishedRequest:
    """Timings of a finished request, for metrics. Times are time.monotonic()."""

    output: RequestOutput
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    finish_reason: str  # the first output's ("stop", "length", "abort", "error")


@dataclass(slots=True)
class StepReport:
    """What one engine loop iteration did, summarised for metrics (one report per step)."""

    stats: EngineStats
    num_prompt_tokens: int = 0  # prompts whose first token came out this step
    num_generation_tokens: int = 0
    queue_times: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class EngineObserver(Protocol):
    def on_step(self, report: StepReport) -> None: ...


# ---- commands (asyncio loop → engine thread) --------------------------------------------------


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    accepted: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[EngineCore], object]
    done: asyncio.Future[object]


@dataclass(slots=True)
class _Track:
    """Engine-thread bookkeeping of one request (timings the engine does not keep)."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # by output index


# ---- the per-request stream (lives on the asyncio loop) --------------------------------------


class RequestStream:
    """Async iterator over a request's `RequestUpdate`s; raises the request's error, if any.

    Closing it before the request finished (client gone, generator closed) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.finished = False
        self.scheduled = False  # set by the loop when the engine first schedules the request

    def _put(self, update: RequestUpdate) -> None:
        self._queue.put_nowait(update)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.finished:
            self.finished = True
        if update.error is not None:
            raise update.error
        return update

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent; safe from `finally`."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


# ---- the engine -------------------------------------------------------------------------------


class AsyncEngine:
    """The asyncio face of `EngineCore`. Call `start()` from a running loop, then `add_request` /
    `generate`; `ready` turns true once the engine thread has built the `EngineCore`."""

    def __init__(
        self,
        engine_factory: Callable[[], EngineCore],
        *,
        max_queue_len: int | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self._factory = engine_factory
        self.max_queue_len = max_queue_len
        self.observer = observer
        self.engine: EngineCore | None = None  # read-only outside the engine thread
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # inbox: asyncio loop → engine thread; guarded by _cv, which also wakes the idle thread.
        self._cv = threading.Condition()
        self._inbox: deque[_Add | _Abort | _Call] = deque()
        self._stopping = False
        # Engine-thread state.
        self._tracks: dict[str, _Track] = {}
        self._unscheduled: set[str] = set()  # accepted, not yet given a step
        self._stats = EngineStats()
        # Loop state.
        self._streams: dict[str, RequestStream] = {}
        self._num_unscheduled = 0  # submitted, not yet scheduled by the engine: the waiting queue

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None and self.is_alive

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raises the load error if loading failed."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.load_error is not None:
            raise EngineDeadError(f"engine failed to start: {self.load_error}") from self.load_error

    @property
    def stats(self) -> EngineStats:
        """The engine stats as of the end of the last loop iteration (a snapshot, never mutated)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._num_unscheduled

    # ---- requests (asyncio loop) ----------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Submit a request and wait until the engine accepted it.

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
        if params.structured is not None and self.engine is not None:
            # Compile the grammar in a worker thread under its time limit, before the engine sees
            # the request: a slow grammar keeps only this request waiting.
            await self.engine.prepare_structured_async(params)
        accepted: asyncio.Future[None] = self._loop.create_future()
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._num_unscheduled += 1
        self._post(_Add(request_id, prompt, params, priority, time.monotonic(), accepted))
        try:
            await accepted
        except BaseException:
            # Refused, or the caller was cancelled while waiting: forget (and abort) the request.
            if self._streams.pop(request_id, None) is stream:
                self._mark_scheduled(stream)
            stream.finished = True
            self._post(_Abort(request_id))
            raise
        return stream

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
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine_core)` on the engine thread between steps (inspection, invariants)."""
        self._check_serving()
        assert self._loop is not None
        done: asyncio.Future[object] = self._loop.create_future()
        self._post(_Call(fn, done))
        return await done  # type: ignore[return-value]

    def _check_serving(self) -> None:
        if self.load_error is not None or (self._thread is not None and not self.is_alive):
            raise EngineDeadError("the engine is not running")
        if not self.ready:
            raise EngineNotReadyError("the model is still loading")

    def _post(self, command: _Add | _Abort | _Call) -> None:
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    def _mark_scheduled(self, stream: RequestStream) -> None:
        if not stream.scheduled:
            stream.scheduled = True
            self._num_unscheduled -= 1

    # ---- delivery (asyncio loop) ----------------------------------------------------------
    def _deliver(
        self, updates: dict[str, RequestUpdate], scheduled: list[str], report: StepReport | None
    ) -> None:
        for rid in scheduled:
            stream = self._streams.get(rid)
            if stream is not None:
                self._mark_scheduled(stream)
        for rid, update in updates.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted by the client meanwhile
            if update.finished:
                del self._streams[rid]
                self._mark_scheduled(stream)
            stream._put(update)
        if report is not None and self.observer is not None:
            try:
                self.observer.on_step(report)
            except Exception:  # metrics must never break serving
                logger.exception("engine observer failed")

    @staticmethod
    def _reply(replies: list[tuple[asyncio.Future[Any], object, BaseException | None]]) -> None:
        for future, result, error in replies:
            if future.done():  # the caller was cancelled meanwhile
                continue
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _call_loop(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self._stats = dataclasses.replace(self.engine.get_stats())
        except BaseException as e:
            logger.exception("engine failed to load")
            self.load_error = e
            self._ready.set()
            return
        self._ready.set()
        engine = self.engine
        while True:
            with self._cv:
                while (
                    not self._inbox and not self._stopping and not engine.has_unfinished_requests()
                ):
                    self._cv.wait()  # idle: sleep until a command arrives
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            updates: dict[str, RequestUpdate] = {}
            report = StepReport(stats=self._stats)
            replies: list[tuple[asyncio.Future[Any], object, BaseException | None]] = []
            for cmd in commands:
                self._apply(engine, cmd, report, replies)
            if replies:
                # Snapshot first, so a client that sees its request accepted also sees it counted.
                self._stats = dataclasses.replace(engine.get_stats())
                self._call_loop(self._reply, replies)
            scheduled: list[str] = []
            if engine.has_unfinished_requests():
                self._step(engine, updates, scheduled, report)
            self._stats = dataclasses.replace(engine.get_stats())
            report.stats = self._stats
            self._call_loop(self._deliver, updates, scheduled, report)
        self._fail_all(engine, EngineDeadError("the server is shutting down"), {})

    def _apply(
        self,
        engine: EngineCore,
        cmd: _Add | _Abort | _Call,
        report: StepReport,
        replies: list[tuple[asyncio.Future[Any], object, BaseException | None]],
    ) -> None:
        """Run one command; answers for the loop go to `replies` (future, result, error)."""
        if isinstance(cmd, _Call):
            try:
                replies.append((cmd.done, cmd.fn(engine), None))
            except Exception as e:  # noqa: BLE001 — the caller's error, raised on its side
                replies.append((cmd.done, None, e))
            return
        if isinstance(cmd, _Abort):
            track = self._tracks.pop(cmd.request_id, None)
            self._unscheduled.discard(cmd.request_id)
            if cmd.request_id not in engine.requests:
                return  # finished (or refused) before the abort arrived
            partial = engine.request_output(cmd.request_id)
            engine.abort_request(cmd.request_id)
            if track is not None:
                report.finished.append(
                    self._finished_record(track, partial, time.monotonic(), "abort")
                )
            return
        try:
            engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.arrival_time
            )
        except Exception as e:  # noqa: BLE001 — RequestError or worse: the request's error, not ours
            replies.append((cmd.accepted, None, e))
            return
        self._tracks[cmd.request_id] = _Track(arrival_time=cmd.arrival_time)
        self._unscheduled.add(cmd.request_id)
        replies.append((cmd.accepted, None, None))

    def _step(
        self,
        engine: EngineCore,
        updates: dict[str, RequestUpdate],
        scheduled: list[str],
        report: StepReport,
    ) -> None:
        start = time.monotonic()
        try:
            deltas = engine.step()
        except Exception as e:
            # The step's state is unknown: fail every in-flight request (each client gets an error
            # it can read), free their blocks, and keep serving new requests.
            logger.exception(
                "engine step failed; aborting %d in-flight requests", len(self._tracks)
            )
            self._fail_all(
                engine, EngineStepError(f"engine step failed: {type(e).__name__}: {e}"), updates
            )
            return
        now = time.monotonic()
        for delta in deltas:
            update = updates.get(delta.request_id)
            if update is None:
                update = updates[delta.request_id] = RequestUpdate([], now)
            update.deltas.append(delta)
        for rid in [r for r in self._unscheduled if self._is_scheduled(engine, r)]:
            self._unscheduled.discard(rid)
            track = self._tracks[rid]
            track.scheduled_time = start
            scheduled.append(rid)
            report.queue_times.append(start - track.arrival_time)
        for rid, update in updates.items():
            track = self._tracks.get(rid)
            if track is None:
                continue
            self._time_tokens(
                track, update, now, report, len(engine.requests[rid].prompt_token_ids)
            )
            if engine.requests[rid].finished:
                update.output = engine.pop_finished(rid)
                del self._tracks[rid]
                report.finished.append(self._finished_record(track, update.output, now))

    @staticmethod
    def _is_scheduled(engine: EngineCore, rid: str) -> bool:
        state = engine.requests.get(rid)
        return state is not None and any(
            s.status is not SequenceStatus.WAITING or s.num_computed_tokens > 0 for s in state.seqs
        )

    @staticmethod
    def _time_tokens(
        track: _Track, update: RequestUpdate, now: float, report: StepReport, num_prompt: int
    ) -> None:
        for delta in update.deltas:
            n = len(delta.new_token_ids)
            report.num_generation_tokens += n
            if track.first_token_time is None:
                track.first_token_time = now
                report.ttfts.append(now - track.arrival_time)
                report.num_prompt_tokens += num_prompt
            last = track.last_token_time.get(delta.index)
            if last is not None and n:
                report.inter_token_latencies.extend([(now - last) / n] * n)
            track.last_token_time[delta.index] = now

    @staticmethod
    def _finished_record(
        track: _Track, output: RequestOutput, now: float, reason: str | None = None
    ) -> FinishedRequest:
        if reason is None:
            reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
        return FinishedRequest(
            output, track.arrival_time, track.scheduled_time, track.first_token_time, now, reason
        )

    def _fail_all(
        self, engine: EngineCore, error: Exception, updates: dict[str, RequestUpdate]
    ) -> None:
        now = time.monotonic()
        for rid in list(self._tracks):
            try:
                engine.abort_request(rid)
            except Exception:  # the engine is already in trouble; free what can be freed
                logger.exception("abort of %s failed", rid)
                engine.requests.pop(rid, None)
            updates[rid] = RequestUpdate([], now, error=error)
        self._tracks.clear()
        self._unscheduled.clear()
        if updates:
            self._call_loop(self._deliver, dict(updates), [], None)
            updates.clear()
