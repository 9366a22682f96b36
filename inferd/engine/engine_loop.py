"""The engine side of `AsyncEngine`: one loop that applies commands, runs a step and emits what
happened, as plain picklable records.

The same loop runs on a thread of the server process or in a process of its own
(`engine_proc.py`); it neither knows nor cares which. It takes commands through `take(timeout)`
and hands every message to `emit`:

    AddRequest / AbortRequest / CallEngine ──► EngineLoop ──► Replies   (accepted or refused; call results)
                                                         └──► StepDone  (per-request deltas, timings, stats)

`EngineCore` is not thread-safe: only the loop touches it. Grammar compilation for structured
outputs is the one slow part of admitting a request, so it runs on a worker thread and the
request joins the engine once its grammar is ready; steps never wait for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.engine.core import KV_POLL_S, EngineCore
from inferd.engine.outputs import RequestOutput, SequenceDelta
from inferd.engine.stats import EngineStats
from inferd.loader.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams
from inferd.scheduler.sequence import SequenceStatus

logger = logging.getLogger("inferd.async_engine")

# While a grammar compiles and nothing else runs, look for it this often (seconds).
_COMPILE_POLL_S = 0.002
# Held news (stream_interval, stream=False requests): a step's metrics wait at most this long.
_REPORT_EVERY_S = 0.1
# A step's report carries a snapshot of the engine's stats when a request started or ended in it,
# and otherwise at most this often: the gauges need no fresher, and a snapshot per step cost ~20
# µs of the engine's main thread at batch 1 (cold caches), then as much again to send.
_STATS_EVERY_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine has stopped; the server cannot serve any more requests."""


class EngineStepError(RuntimeError):
    """`EngineCore.step()` raised while this request was in flight; the request was aborted."""


# ---- what the front end learns (engine → front end) -------------------------------------------


@dataclass(slots=True)
class EngineInfo:
    """What the front end needs to know about the loaded engine; it never touches `EngineCore`."""

    tokenizer: Tokenizer
    max_model_len: int
    source: str | None
    file_type: str | None
    dtype: str
    device: str
    resident_bytes: int = 0  # weights and KV pools (a draft model's too), as planned at load

    @classmethod
    def of(cls, core: EngineCore) -> EngineInfo:
        plan = core.memory_plan
        return cls(
            core.tokenizer,
            core.max_model_len,
            str(core.source) if core.source is not None else None,
            core.file_type,
            str(core.dtype).removeprefix("torch."),
            str(core.device),
            plan.weight_bytes + plan.kv_bytes + plan.draft_weight_bytes + plan.draft_kv_bytes,
        )


@dataclass(slots=True)
class RequestUpdate:
    """One step's news about one request: its deltas, and on the last update its final output."""

    deltas: list[SequenceDelta]
    time: float  # time.monotonic() at the end of the step (system-wide: valid in any process)
    output: RequestOutput | None = None  # set once: the request is finished (or aborted)
    error: Exception | None = None  # set once: the request failed; no more updates follow

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None

    @property
    def num_new_tokens(self) -> int:
        """Tokens the update brings to its furthest output (outputs advance together)."""
        return max((len(d.new_token_ids) for d in self.deltas), default=0)

    def then(self, later: RequestUpdate) -> RequestUpdate:
        """This update followed by `later`, as one: each output's tokens, text and logprobs
        joined, the finish (and final output or error) of the later."""
        deltas = {d.index: d for d in self.deltas}
        for d in later.deltas:
            first = deltas.get(d.index)
            deltas[d.index] = d if first is None else SequenceDelta(
                d.request_id, d.index, first.new_token_ids + d.new_token_ids,
                first.text_delta + d.text_delta, d.finish_reason, d.stop_reason,
                first.new_logprobs + d.new_logprobs,
            )  # fmt: skip
        return RequestUpdate(list(deltas.values()), later.time, later.output, later.error)


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

    stats: EngineStats | None  # None: as in the last report that had them
    num_prompt_tokens: int = 0  # prompts whose first token came out this step
    num_generation_tokens: int = 0
    queue_times: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)

    def then(self, later: StepReport) -> StepReport:
        """The report of this step and `later`'s together (the later stats)."""
        return StepReport(
            later.stats if later.stats is not None else self.stats,
            self.num_prompt_tokens + later.num_prompt_tokens,
            self.num_generation_tokens + later.num_generation_tokens,
            self.queue_times + later.queue_times,
            self.ttfts + later.ttfts,
            self.inter_token_latencies + later.inter_token_latencies,
            self.finished + later.finished,
        )


@dataclass(slots=True)
class Loaded:
    """The engine finished loading: `info` and `stats`, or the `error` that stopped it."""

    info: EngineInfo | None
    stats: EngineStats | None
    error: BaseException | None = None


@dataclass(slots=True)
class Replies:
    """Answers to commands: `accepted` has (request_id, refusal or None), `calls` has
    (call_id, result, error). Sent before the step, so a client learns of its acceptance
    without waiting for one."""

    accepted: list[tuple[str, BaseException | None]]
    calls: list[tuple[int, object, BaseException | None]]
    stats: EngineStats | None  # None: unchanged


@dataclass(slots=True)
class Exited:
    """The engine stopped: shut down, crashed, or its process died. Nothing follows."""

    reason: str


@dataclass(slots=True)
class StepDone:
    updates: dict[str, RequestUpdate]
    scheduled: list[str]  # requests given their first step in this iteration
    report: StepReport | None


Message = Loaded | Replies | StepDone | Exited


# ---- commands (front end → engine) ------------------------------------------------------------


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: bool = True  # False: its client wants the final output only (no news per step)


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class CallEngine:
    """Run `fn(engine_core)` between steps (inspection, invariants, prefix-cache reset)."""

    call_id: int
    fn: Callable[[EngineCore], object]


Command = AddRequest | AbortRequest | CallEngine


@dataclass(slots=True)
class _Track:
    """The loop's one record of a request it accepted: the timings the engine does not keep and
    what it holds back of the request's news. Forgetting a request is popping its track."""

    arrival_time: float
    final_only: bool = False  # added with stream=False: only its final output goes out
    scheduled_time: float | None = None  # None: not given a step yet
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # by output index
    streaming: bool = False  # its first tokens went out
    held: RequestUpdate | None = None  # news not sent yet


# ---- the loop ---------------------------------------------------------------------------------


class EngineLoop:
    """Runs the engine: applies commands, steps, and emits what happened.

    `stream_interval` > 1 (`inferd serve --stream-interval`, SGLang's flag): a request's first
    tokens go out at once, then its news is held until it brings that many tokens or the request
    ends; a step whose news is all held sends nothing (its metrics ride with the next message,
    at least every `_REPORT_EVERY_S`). A request added with `stream=False` has its news held
    until it ends (as SGLang does): its client only reads the final output, and the front end
    no longer wakes on every step for it (~5 % of a batch-1 `-q auto` step, measured).
    Fewer messages and SSE chunks: less front-end and client CPU per token."""

    def __init__(
        self, core: EngineCore, emit: Callable[[Message], None], stream_interval: int = 1
    ) -> None:
        self.core = core
        self.emit = emit
        self.stats = core.get_stats().snapshot()
        self._stats_time = time.monotonic()  # when `stats` was taken
        self._tracks: dict[str, _Track] = {}  # accepted requests, until their end is sent
        # Requests whose grammar is compiling, in arrival order.
        self._compiling: dict[str, tuple[AddRequest, cf.Future[None]]] = {}
        self._compiler: cf.ThreadPoolExecutor | None = None
        self._interval = stream_interval
        self._num_final_only = 0  # tracks with final_only
        self._held_report: StepReport | None = None  # metrics of steps that sent nothing
        self._last_step_sent = time.monotonic()

    def run(self, take: Callable[[float | None], list[Command] | None]) -> None:
        """Serve until `take` says stop. `take(timeout)` returns the commands that arrived,
        waiting up to `timeout` seconds for one (None: as long as it takes), or None to stop."""
        while True:
            if self.core.has_runnable_requests():
                timeout: float | None = 0.0
            elif self.core.has_unfinished_requests() or self.core.has_pending_kv_transfers():
                timeout = KV_POLL_S  # blocks wait for a KV load or send to complete
            else:
                timeout = _COMPILE_POLL_S if self._compiling else None  # idle: sleep
            commands = take(timeout)
            if commands is None:
                break
            self.iterate(commands)
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        error = EngineDeadError("the server is shutting down")
        if self._compiling:
            self.emit(Replies([(rid, error) for rid in self._compiling], [], self.stats))
            self._compiling.clear()
        self.fail_all(error)
        self.core.close()  # its KV connector's last writes (a KV tier keeps the prefix cache)

    def iterate(self, commands: list[Command]) -> None:
        """Apply the commands, run one step if there is work, and emit what happened."""
        core = self.core
        report = StepReport(stats=None)
        accepted: list[tuple[str, BaseException | None]] = []
        calls: list[tuple[int, object, BaseException | None]] = []
        for cmd in commands:
            self._apply(cmd, report, accepted, calls)
        self._admit_compiled(accepted)
        if accepted or calls:
            # Snapshot first, so a client that sees its request accepted also sees it counted.
            self._snapshot_stats()
            self.emit(Replies(accepted, calls, self.stats))
        updates: dict[str, RequestUpdate] = {}
        scheduled: list[str] = []
        ended: dict[str, _Track] = {}  # tracks of the requests that finished this step
        stepped = core.has_unfinished_requests()
        if stepped:
            self._step(updates, scheduled, report, ended)
        elif core.has_pending_kv_transfers():
            core.step()  # nothing runs: it frees the blocks of completed KV sends
            if not commands and not accepted:
                return
        elif not commands and not accepted and not report.finished:
            # An idle poll while a grammar compiles (every 2 ms): nothing happened, and a
            # message would wake the front end for nothing.
            return
        if (
            scheduled
            or report.finished
            or report.num_prompt_tokens
            or time.monotonic() - self._stats_time >= _STATS_EVERY_S
        ):
            report.stats = self._snapshot_stats()
        holding = self._num_final_only or any(t.held is not None for t in ended.values())
        if self._interval > 1 or holding or self._held_report is not None:
            ready = self._hold(updates, scheduled, report, ended)
            if ready is None:
                return
            updates, report = ready
        self._last_step_sent = time.monotonic()
        self.emit(StepDone(updates, scheduled, report))

    def _snapshot_stats(self) -> EngineStats:
        self.stats = self.core.get_stats().snapshot()
        self._stats_time = time.monotonic()
        return self.stats

    def _hold(
        self,
        updates: dict[str, RequestUpdate],
        scheduled: list[str],
        report: StepReport,
        ended: dict[str, _Track],
    ) -> tuple[dict[str, RequestUpdate], StepReport] | None:
        """What of this step's news (and the news held so far) goes out now under
        `stream_interval` and `stream=False`; None when nothing does."""
        ready: dict[str, RequestUpdate] = {}
        for rid, update in updates.items():
            track = self._tracks.get(rid) or ended.get(rid)
            if track is None:  # failed (`fail_all`): its error goes out now
                ready[rid] = update
                continue
            if track.held is not None:
                update = track.held.then(update)
                track.held = None
            if not update.finished:  # a finished request's news all goes out now
                if track.final_only or (track.streaming and update.num_new_tokens < self._interval):
                    track.held = update
                    continue
                track.streaming = track.streaming or update.num_new_tokens > 0
            ready[rid] = update
        if self._held_report is not None:
            report = self._held_report.then(report)
            self._held_report = None
        quiet_for = time.monotonic() - self._last_step_sent
        if not (ready or scheduled or report.finished) and quiet_for < _REPORT_EVERY_S:
            self._held_report = report
            return None
        return ready, report

    # ---- commands -------------------------------------------------------------------------
    def _apply(
        self,
        cmd: Command,
        report: StepReport,
        accepted: list[tuple[str, BaseException | None]],
        calls: list[tuple[int, object, BaseException | None]],
    ) -> None:
        core = self.core
        if isinstance(cmd, CallEngine):
            try:
                calls.append((cmd.call_id, cmd.fn(core), None))
            except Exception as e:  # noqa: BLE001 — the caller's error, raised on its side
                calls.append((cmd.call_id, None, e))
            return
        if isinstance(cmd, AbortRequest):
            if self._compiling.pop(cmd.request_id, None) is not None:
                return  # its grammar was still compiling: it never reached the engine
            track = self._forget(cmd.request_id)  # held news too: its client is gone
            if cmd.request_id not in core.requests:
                return  # finished (or refused) before the abort arrived
            partial = core.request_output(cmd.request_id)
            core.abort_request(cmd.request_id)
            if track is not None:
                report.finished.append(_finished_record(track, partial, time.monotonic(), "abort"))
            return
        if cmd.params.structured is not None and cmd.request_id not in self._compiling:
            if self._compiler is None:
                self._compiler = cf.ThreadPoolExecutor(2, thread_name_prefix="inferd-grammar")
            self._compiling[cmd.request_id] = (
                cmd,
                self._compiler.submit(core.prepare_structured, cmd.params),
            )
            return
        self._add(cmd, accepted)

    def _admit_compiled(self, accepted: list[tuple[str, BaseException | None]]) -> None:
        for rid, (cmd, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            error = fut.exception()
            if error is not None:
                accepted.append((rid, error))
            else:
                self._add(cmd, accepted)

    def _add(self, cmd: AddRequest, accepted: list[tuple[str, BaseException | None]]) -> None:
        try:
            self.core.add_request(
                cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.arrival_time
            )
        except Exception as e:  # noqa: BLE001 — RequestError or worse: the request's error, not ours
            accepted.append((cmd.request_id, e))
            return
        self._tracks[cmd.request_id] = _Track(cmd.arrival_time, final_only=not cmd.stream)
        self._num_final_only += not cmd.stream
        accepted.append((cmd.request_id, None))

    def _forget(self, request_id: str) -> _Track | None:
        """Drop a request's track (and what it held back); returns it."""
        track = self._tracks.pop(request_id, None)
        if track is not None:
            self._num_final_only -= track.final_only
        return track

    # ---- the step -------------------------------------------------------------------------
    def _step(
        self,
        updates: dict[str, RequestUpdate],
        scheduled: list[str],
        report: StepReport,
        ended: dict[str, _Track],
    ) -> None:
        core = self.core
        start = time.monotonic()
        try:
            deltas = core.step()
        except Exception as e:
            # The step's state is unknown: fail every in-flight request (each client gets an error
            # it can read), free their blocks, and keep serving new requests.
            logger.exception(
                "engine step failed; aborting %d in-flight requests", len(self._tracks)
            )
            self.fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"), updates)
            return
        now = time.monotonic()
        for delta in deltas:
            update = updates.get(delta.request_id)
            if update is None:
                update = updates[delta.request_id] = RequestUpdate([], now)
            update.deltas.append(delta)
        for rid, track in self._tracks.items():
            if track.scheduled_time is not None or not _is_scheduled(core, rid):
                continue
            track.scheduled_time = start
            scheduled.append(rid)
            report.queue_times.append(start - track.arrival_time)
        for rid, update in updates.items():
            track = self._tracks.get(rid)
            if track is None:
                continue
            _time_tokens(track, update, now, report, len(core.requests[rid].prompt_token_ids))
            if core.requests[rid].finished:
                update.output = core.pop_finished(rid)
                ended[rid] = self._forget(rid)
                report.finished.append(_finished_record(track, update.output, now))

    def fail_all(self, error: Exception, updates: dict[str, RequestUpdate] | None = None) -> None:
        """Abort every request with `error` and tell their clients (now, or in `updates`)."""
        core = self.core
        now = time.monotonic()
        out = updates if updates is not None else {}
        for rid in list(self._tracks):
            try:
                core.abort_request(rid)
            except Exception:  # the engine is already in trouble; free what can be freed
                logger.exception("abort of %s failed", rid)
                core.requests.pop(rid, None)
            out[rid] = RequestUpdate([], now, error=error)
        self._tracks.clear()  # held news too: the error ends those streams
        self._num_final_only = 0
        if updates is None and out:
            self.emit(StepDone(out, [], None))


def _is_scheduled(core: EngineCore, rid: str) -> bool:
    state = core.requests.get(rid)
    return state is not None and any(
        s.status is not SequenceStatus.WAITING or s.num_computed_tokens > 0 for s in state.seqs
    )


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


def _finished_record(
    track: _Track, output: RequestOutput, now: float, reason: str | None = None
) -> FinishedRequest:
    if reason is None:
        reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
    return FinishedRequest(
        output, track.arrival_time, track.scheduled_time, track.first_token_time, now, reason
    )
