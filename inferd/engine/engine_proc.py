"""The engine loop in a process of its own, as vLLM V1 runs its engine core.

Why: on a thread, the engine shares the server's GIL with the event loop. Each streamed token
costs the loop a fraction of a millisecond of Python (JSON, SSE, HTTP), and when the OS preempts
the loop while it holds the GIL, the engine thread waits for it between kernels. A process of its
own has its own GIL, and when it dies the server stays up to answer 503 `engine_dead`.
The price is a pipe and a pickle per step, kept small: a step's news travels as tuples, and the
front end runs on the CPU the engine's main thread does not (`_bind_cpus`).

    server process                                     engine process (spawned)
    --------------                                     --------------
    AsyncEngine ─ writer thread ─ commands pipe ──►    take(): commands, between steps
                ◄─ asyncio reader ◄─ messages pipe ◄── emit(): Loaded, Replies, StepDone

Each pipe carries frames: an 8-byte little-endian length, then a pickle (cloudpickle for
commands, whose `CallEngine.fn` may be a lambda). The event loop reads its pipe without blocking
and keeps a partial frame for the next wake-up; the engine writes whole frames. The engine process
ignores SIGINT (the server shuts it down with a stop command) and exits when the commands pipe
closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import struct
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import cloudpickle
import psutil

from inferd.engine.core import EngineCore
from inferd.engine.engine_loop import (
    AddRequest,
    CallEngine,
    Command,
    EngineInfo,
    EngineLoop,
    Exited,
    Loaded,
    Message,
    Replies,
    RequestUpdate,
    StepDone,
    StepReport,
)
from inferd.engine.heap import freeze_heap
from inferd.engine.outputs import SequenceDelta
from inferd.engine.stats import EngineStats

logger = logging.getLogger("inferd.async_engine")

_STOP = None  # the command that ends the engine loop


_HEADER = struct.Struct("<Q")
_READ_SIZE = 1 << 16


def write_frame(fd: int, blob: bytes) -> None:
    """Write one frame to a blocking pipe (all of it, however many writes that takes)."""
    view = memoryview(_HEADER.pack(len(blob)) + blob)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Splits the bytes read from a pipe into whole frames, keeping a partial one for later."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def partial(self) -> bool:
        return bool(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        if not buffer and len(data) >= _HEADER.size:  # the common case: one whole frame
            (size,) = _HEADER.unpack_from(data)
            if len(data) == _HEADER.size + size:
                return [data[_HEADER.size :]]
        buffer += data
        frames = []
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            frames.append(bytes(buffer[start + _HEADER.size : end]))
            start = end
        del buffer[:start]
        return frames


_OMP_BINDING = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def _bind_cpus(process: multiprocessing.process.BaseProcess, cpus: list[int]) -> int | None:
    """Start `process` with its OpenMP threads bound one per core from the first, and move this
    process (the HTTP front end) to the last CPU; returns that CPU, or None if nothing was bound.

    Why: the front end's work on each token (~0.5 ms of cold Python here) lands on whichever CPU
    the scheduler picks. On the engine's main thread's CPU it preempted the engine for all of it;
    on the last CPU it shares with the last OpenMP worker, which sits idle while the engine's
    main thread runs the step's Python (scheduling, sampling, detokenizing), so most of it is
    free. With fewer OpenMP threads than CPUs, the last CPU is the front end's alone. The user's
    own OMP_* binding, or a single CPU, leaves everything as it is.
    """
    if len(cpus) < 2 or any(name in os.environ for name in _OMP_BINDING):
        process.start()
        return None
    # A restarted engine is spawned by a front end already moved to the last CPU: the child
    # inherits this thread's mask, so widen it back to every CPU for the spawn.
    os.sched_setaffinity(0, cpus)
    os.environ.update(OMP_PROC_BIND="close", OMP_PLACES="cores")  # read by the child's libgomp
    try:
        process.start()
    finally:
        del os.environ["OMP_PROC_BIND"], os.environ["OMP_PLACES"]
    for tid in os.listdir("/proc/self/task"):  # every thread; later ones inherit the mask
        try:
            os.sched_setaffinity(int(tid), {cpus[-1]})
        except OSError:  # a thread that just ended
            pass
    return cpus[-1]


def pin_process(cpus: Sequence[int]) -> None:
    """Pin every thread of this process to `cpus` (threads started later inherit the mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


# ---- a step's news on the wire: tuples, not dataclasses --------------------------------------
# Slotted dataclasses pickle through `__getstate__`/`__setstate__` written in Python: a one-token
# StepDone took ~19 µs to pickle and ~14 µs to unpickle, ~8× that on the cold caches of a process
# that wakes once per token. As nested tuples it takes ~2 + 3 µs. The engine's stats travel only
# in the reports that carry a snapshot (`engine_loop._STATS_EVERY_S`).

_STEP = "step"
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))


def encode_step(step: StepDone) -> tuple:
    updates = [
        (rid, u.time, [(d.index, d.new_token_ids, d.text_delta, d.finish_reason, d.stop_reason,
                        d.new_logprobs or None) for d in u.deltas], u.output, u.error)
        for rid, u in step.updates.items()
    ]  # fmt: skip
    report = None
    r = step.report
    if r is not None:
        stats = tuple(getattr(r.stats, f) for f in _STATS_FIELDS) if r.stats is not None else None
        report = (stats, r.num_prompt_tokens, r.num_generation_tokens, r.queue_times, r.ttfts,
                  r.inter_token_latencies, r.finished)  # fmt: skip
    return (_STEP, step.scheduled, updates, report)


def decode_step(wire: tuple) -> StepDone:
    _, scheduled, wire_updates, wire_report = wire
    updates = {}
    for rid, at, deltas, output, error in wire_updates:
        news = [SequenceDelta(rid, i, ids, text, finish, stop, logprobs or [])
                for i, ids, text, finish, stop, logprobs in deltas]  # fmt: skip
        updates[rid] = RequestUpdate(news, at, output, error)
    report = None
    if wire_report is not None:
        stats, *rest = wire_report
        report = StepReport(EngineStats(*stats) if stats is not None else None, *rest)
    return StepDone(updates, scheduled, report)


def encode_message(message: Message) -> bytes:
    """A message from the engine as bytes (a step as tuples; what does not pickle, replaced)."""
    wire: object = message
    if isinstance(message, StepDone):
        wire = encode_step(message)
    elif isinstance(message, Loaded) and message.error is not None:
        wire = Loaded(None, None, _picklable_error(message.error))
    try:
        return pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 — a call's result or an error that does not pickle
        return pickle.dumps(_picklable(message), protocol=pickle.HIGHEST_PROTOCOL)


def decode_message(blob: bytes) -> Message:
    message = pickle.loads(blob)
    return decode_step(message) if type(message) is tuple else message


def _refusal(command: Command | None, error: Exception) -> Replies:
    """The answer to a command that could not be sent (a call's function, a request's
    parameters that do not pickle): its caller gets the error, the engine never sees it."""
    if isinstance(command, CallEngine):
        return Replies([], [(command.call_id, None, error)], None)
    if isinstance(command, AddRequest):
        return Replies([(command.request_id, error)], [], None)
    raise error  # a stop or an abort always pickles


class ProcessBackend:
    """Runs `engine_factory()` and the engine loop in a spawned process."""

    core: EngineCore | None = None  # never in this process

    def __init__(
        self,
        engine_factory: Callable[[], EngineCore],
        bind_cpus: bool = False,
        stream_interval: int = 1,
        cpus: Sequence[int] | None = None,
        threads: int | None = None,
    ) -> None:
        """`cpus`: the cores of this engine alone (a data-parallel replica's share): its process
        is pinned to them and the front end is not moved. `threads`: torch's threads in the
        engine (default: one per core it may use)."""
        # Pickled now, so a factory that cannot travel fails where it is built, not at start-up.
        self._factory_blob = cloudpickle.dumps(engine_factory)
        # Binding moves this whole process to one CPU: right for `inferd serve`, whose process
        # is the front end; wrong for a library caller (a test suite ran 2x slower after it).
        self._bind = bind_cpus and cpus is None
        self._cpus = sorted(os.sched_getaffinity(0))  # before this process moves (`_bind_cpus`)
        self._pinned = sorted(cpus) if cpus is not None else None
        self._threads = threads
        self._stream_interval = stream_interval
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None  # our ends of the two pipes
        self._messages: Connection | None = None
        self._reader = FrameReader()
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork would copy the server's threads' locks
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._messages, messages_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=serve_engine,
            args=(self._factory_blob, commands_in, messages_out,
                  logging.getLogger().getEffectiveLevel(), self._stream_interval,
                  self._pinned, self._threads),
            name="inferd-engine",
            daemon=True,  # killed with the server if it exits without a shutdown
        )  # fmt: skip
        front_cpu = _bind_cpus(self._process, self._cpus) if self._bind else self._process.start()
        if front_cpu is not None:
            logger.info("engine threads bound to cores from the first; HTTP front end on CPU %d",
                        front_cpu)  # fmt: skip
        commands_in.close()
        messages_out.close()
        self._loop = loop
        self._on_message = on_message
        os.set_blocking(self._messages.fileno(), False)
        loop.add_reader(self._messages.fileno(), self._read)
        threading.Thread(target=self._write, name="inferd-engine-writer", daemon=True).start()

    def fresh(self) -> ProcessBackend:
        """A backend like this one, not started: the supervisor's replacement engine."""
        other = copy.copy(self)  # the factory, binding and CPUs; none of the running state
        other._process = other._commands = other._messages = None
        other._reader = FrameReader()
        other._outbox = queue.SimpleQueue()
        return other

    def send(self, command: Command) -> None:
        self._outbox.put(command)

    def stop(self, timeout: float | None) -> None:
        if self._process is None:
            return
        self._outbox.put(_STOP)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %s s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def cpu_seconds(self) -> float | None:
        """The engine process's CPU time, its rank processes' included."""
        if self._process is None or self._process.pid is None:
            return None
        try:
            process = psutil.Process(self._process.pid)
            total = sum(process.cpu_times()[:2])
            for child in process.children(recursive=True):
                try:
                    total += sum(child.cpu_times()[:2])
                except psutil.Error:  # a rank that just ended
                    pass
        except psutil.Error:
            return None
        return total

    def _exit_status(self) -> str:
        """' (killed by SIGKILL)', ' (exit code 1)', or '' while it is still exiting."""
        assert self._process is not None
        self._process.join(0.5)  # its pipe closed: it is exiting, if not gone already
        code = self._process.exitcode
        if code is None:
            return ""
        if code < 0:
            try:
                return f" (killed by {signal.Signals(-code).name})"
            except ValueError:
                return f" (killed by signal {-code})"
        return f" (exit code {code})"

    def _write(self) -> None:
        """Send commands in order, off the event loop: a long prompt may not fit the pipe's
        buffer while the engine is busy in a step, and the loop must not wait for that."""
        assert self._commands is not None
        fd = self._commands.fileno()
        try:
            while True:
                command = self._outbox.get()
                try:
                    blob = cloudpickle.dumps(command)
                except Exception as e:  # noqa: BLE001 — the command's own problem: answer its caller
                    self._loop.call_soon_threadsafe(self._on_message, _refusal(command, e))
                    continue
                try:
                    write_frame(fd, blob)
                except OSError:
                    return  # the engine process is gone; the reader reports it
                if command is _STOP:
                    return
        finally:
            self._commands.close()  # here, not elsewhere: no other pipe may reuse the fd meanwhile

    def _read(self) -> None:
        """On the event loop, whenever the pipe is readable: hand over every whole message."""
        assert self._messages is not None
        fd = self._messages.fileno()
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the engine process exited (or crashed)
                self._loop.remove_reader(fd)
                self._messages.close()
                self._on_message(Exited(f"the engine process stopped{self._exit_status()}"))
                return
            for frame in self._reader.feed(data):
                self._on_message(decode_message(frame))
            if len(data) < _READ_SIZE:
                return


# ---- in the engine process --------------------------------------------------------------------


def serve_engine(
    factory_blob: bytes,
    commands: Connection,
    messages: Connection,
    log_level: int,
    stream_interval: int = 1,
    cpus: Sequence[int] | None = None,
    threads: int | None = None,
) -> None:
    """The engine process's main: build the engine, then run its loop until told to stop."""
    from inferd.logging_setup import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
    configure_logging(log_level)
    if cpus is not None:
        pin_process(cpus)
    if threads is not None or cpus is not None:
        import torch

        torch.set_num_threads(threads or len(cpus or ()))
    commands_fd, messages_fd = commands.fileno(), messages.fileno()
    reader = FrameReader()

    def emit(message: Message) -> None:
        blob = encode_message(message)
        try:
            write_frame(messages_fd, blob)
        except (BrokenPipeError, ConnectionResetError):
            raise SystemExit(0) from None  # the server is gone: nothing left to serve

    def take(timeout: float | None) -> list[Command] | None:
        commands: list[Command] = []
        # A partial frame means the rest is on its way: wait for it.
        while select.select([commands_fd], [], [], None if reader.partial else timeout)[0]:
            data = os.read(commands_fd, _READ_SIZE)
            if not data:
                return None  # the server is gone
            for frame in reader.feed(data):
                command = pickle.loads(frame)
                if command is _STOP:
                    return None
                commands.append(command)
            if not reader.partial:
                break
        return commands

    try:
        core = cloudpickle.loads(factory_blob)()
        info = EngineInfo.of(core)
    except BaseException as e:
        logging.getLogger("inferd.async_engine").exception("engine failed to load")
        emit(Loaded(None, None, e))
        return
    engine_loop = EngineLoop(core, emit, stream_interval)
    freeze_heap()
    emit(Loaded(info, engine_loop.stats))
    engine_loop.run(take)


def _picklable_error(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 — whatever fails to round-trip goes as a plain copy
        return RuntimeError(f"{type(error).__name__}: {error}")


def _picklable(message: Message) -> Message:
    """A `Replies` whose call results and errors all pickle (others always do)."""
    if not isinstance(message, Replies):
        raise TypeError(f"cannot send {type(message).__name__} to the server")
    calls: list[tuple[int, object, BaseException | None]] = []
    for call_id, result, error in message.calls:
        try:
            pickle.dumps(result)
        except Exception as e:  # noqa: BLE001 — any result that does not pickle
            result, error = None, RuntimeError(f"the call's result cannot be sent back: {e}")
        calls.append((call_id, result, _picklable_error(error) if error else None))
    accepted = [(rid, _picklable_error(e) if e else None) for rid, e in message.accepted]
    return Replies(accepted, calls, message.stats)
