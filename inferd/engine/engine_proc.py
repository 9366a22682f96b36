"""The engine loop in a process of its own, as vLLM V1 runs its engine core.

Why: on a thread, the engine shares the server's GIL with the event loop. Each streamed token
costs the loop a fraction of a millisecond of Python (JSON, SSE, HTTP), and when the OS preempts
the loop while it holds the GIL, the engine thread waits for it between kernels. A process of its
own has its own GIL, and when it dies the server stays up to answer 503 `engine_dead`.
The price is a pickle per step each way (see `async_engine.py` for the measured trade-off).

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
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import cloudpickle

from inferd.engine.core import EngineCore
from inferd.engine.engine_loop import (
    CallEngine,
    Command,
    EngineInfo,
    EngineLoop,
    Exited,
    Loaded,
    Message,
    Replies,
)
from inferd.engine.heap import freeze_heap

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


class ProcessBackend:
    """Runs `engine_factory()` and the engine loop in a spawned process."""

    core: EngineCore | None = None  # never in this process

    def __init__(self, engine_factory: Callable[[], EngineCore]) -> None:
        # Pickled now, so a factory that cannot travel fails where it is built, not at start-up.
        self._factory_blob = cloudpickle.dumps(engine_factory)
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
            args=(self._factory_blob, commands_in, messages_out, logging.getLogger().getEffectiveLevel()),
            name="inferd-engine",
            daemon=True,  # killed with the server if it exits without a shutdown
        )  # fmt: skip
        self._process.start()
        commands_in.close()
        messages_out.close()
        self._loop = loop
        self._on_message = on_message
        os.set_blocking(self._messages.fileno(), False)
        loop.add_reader(self._messages.fileno(), self._read)
        threading.Thread(target=self._write, name="inferd-engine-writer", daemon=True).start()

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

    def _write(self) -> None:
        """Send commands in order, off the event loop: a long prompt may not fit the pipe's
        buffer while the engine is busy in a step, and the loop must not wait for that."""
        assert self._commands is not None
        fd = self._commands.fileno()
        while True:
            command = self._outbox.get()
            try:
                blob = cloudpickle.dumps(command)
            except Exception as e:  # only a call's function can fail to pickle: tell its caller
                if isinstance(command, CallEngine):
                    reply = Replies([], [(command.call_id, None, e)], None)
                    self._loop.call_soon_threadsafe(self._on_message, reply)
                    continue
                raise
            try:
                write_frame(fd, blob)
            except OSError:
                return  # the engine process is gone; the reader reports it
            if command is _STOP:
                return

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
                self._on_message(Exited("the engine process stopped"))
                return
            for frame in self._reader.feed(data):
                self._on_message(pickle.loads(frame))
            if len(data) < _READ_SIZE:
                return


# ---- in the engine process --------------------------------------------------------------------


def serve_engine(
    factory_blob: bytes, commands: Connection, messages: Connection, log_level: int
) -> None:
    """The engine process's main: build the engine, then run its loop until told to stop."""
    from inferd.cli import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
    configure_logging(log_level)
    commands_fd, messages_fd = commands.fileno(), messages.fileno()
    reader = FrameReader()

    def emit(message: Message) -> None:
        try:
            blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            blob = pickle.dumps(_picklable(message), protocol=pickle.HIGHEST_PROTOCOL)
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
        emit(Loaded(None, None, _picklable_error(e)))
        return
    engine_loop = EngineLoop(core, emit)
    freeze_heap()
    emit(Loaded(info, engine_loop.stats))
    engine_loop.run(take)


def _picklable_error(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _picklable(message: Message) -> Message:
    """A `Replies` whose call results and errors all pickle (others always do)."""
    if not isinstance(message, Replies):
        raise TypeError(f"cannot send {type(message).__name__} to the server")
    calls: list[tuple[int, object, BaseException | None]] = []
    for call_id, result, error in message.calls:
        try:
            pickle.dumps(result)
        except Exception as e:
            result, error = None, RuntimeError(f"the call's result cannot be sent back: {e}")
        calls.append((call_id, result, _picklable_error(error) if error else None))
    accepted = [(rid, _picklable_error(e) if e else None) for rid, e in message.accepted]
    return Replies(accepted, calls, message.stats)
