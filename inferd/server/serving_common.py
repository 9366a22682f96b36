"""What the completions and chat endpoints share: the server state, request checks, sampling
parameters, request logging, SSE framing and client-disconnect handling."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from inferd.engine.async_engine import RequestStream, RequestUpdate
from inferd.engine.outputs import RequestOutput
from inferd.loader.tokenizer import Tokenizer
from inferd.lora.request import LoRARequest
from inferd.sampling.params import SamplingParams
from inferd.server.errors import APIError, error_body, to_api_error
from inferd.server.fair_share import share_window
from inferd.server.limits import AdmissionLimits, check_queue, check_request
from inferd.server.privacy import bearer_token, cache_salt, shown_prompt
from inferd.server.protocol import _SamplingFields
from inferd.server.replicas import ReplicaSet
from inferd.server.stream_guards import Deadline, check_timeout, drop_client_on_overflow
from inferd.structured import StructuredOutputsParams
from inferd.structured.tool_parsers import ToolParser, tool_parser

logger = logging.getLogger("inferd.server")

T = TypeVar("T")

MAX_N = 128  # OpenAI's own limit on `n`; also bounds the sequences one request may fork
_INT64 = 2**63  # seeds and top_k end up in int64 tensors / torch.Generator


@dataclass(slots=True)
class ServerState:
    replicas: ReplicaSet  # the engines (one, or --data-parallel-size of them)
    served_model_names: list[str]
    max_log_len: int | None = None
    log_requests: bool = False
    tool_call_parser: str = "auto"  # --tool-call-parser: a name in TOOL_PARSERS, or "auto"
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    prefix_cache_isolation: str = "none"  # privacy.py
    allow_control_tokens_in_content: bool = False  # control_tokens.py
    created: int = field(default_factory=lambda: int(time.time()))
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters: name → path

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if model is None or model in self.served_model_names or model in self.lora_modules:
            return model or self.model_name
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in [*self.served_model_names, *self.lora_modules])}",
            param="model",
            code="model_not_found",
        )

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a request for `model` (checked by `check_model`) runs under."""
        return LoRARequest(model) if model in self.lora_modules else None

    def ready_replicas(self) -> ReplicaSet:
        """The replicas, or 503 while none serves (the model loads, or failed, or died)."""
        if not self.replicas.ready:
            raise self.replicas.request_error()
        return self.replicas

    @property
    def tokenizer(self) -> Tokenizer:
        info = self.ready_replicas().info
        assert info is not None
        return info.tokenizer  # the front end's own copy: encode/decode/render are pure

    def tool_parser(self) -> ToolParser:
        """How this model writes tool calls: the flag's choice, or the chat template's markers."""
        return tool_parser(self.tool_call_parser, self.tokenizer.chat_template)

    @property
    def max_model_len(self) -> int:
        info = self.ready_replicas().info
        assert info is not None
        return info.max_model_len

    def admit(self, req: _SamplingFields, raw: Request, prompts: int = 1) -> str | None:
        """Admission (limits.py: 400 over a limit, 503 over the queue); returns the request's
        prefix-cache salt (privacy.py)."""
        key = bearer_token(raw)
        check_request(self.limits, req, prompts=prompts, api_key=key)
        check_queue(self.limits, self.ready_replicas().num_waiting)
        return cache_salt(self.prefix_cache_isolation, req.cache_salt, key)

    def log_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if not self.log_requests:  # off unless --enable-log-requests: prompts are private
            return
        shown = shown_prompt(prompt, self.max_log_len)
        logger.info("received request %s: prompt: %r, params: %s", request_id, shown, params)


_INLINE_TOKENIZE_CHARS = 16_384  # above this, tokenizing could stall every stream for a while


async def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize without stalling the event loop: long texts go to a worker thread."""
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


def check_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "prompt"
) -> int:
    """The max_tokens to run with; a 400 naming how many tokens over the context it would go."""
    if num_prompt_tokens >= max_model_len:
        over = num_prompt_tokens - max_model_len + 1
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your prompt is {num_prompt_tokens} tokens, {over} tokens over "
            "the limit (at least one token must be generated). Please reduce the "
            "length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        total = num_prompt_tokens + max_tokens
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion), {total - max_model_len} tokens over the "
            "limit. Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def structured_spec(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The grammar a request asks for (response_format or one guided_* field), or None."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            body = fmt.get("json_schema")
            schema = body.get("schema") if isinstance(body, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs `json_schema.schema`, a "
                               "JSON schema object", param="response_format")  # fmt: skip
            asked.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(400, f"response_format type must be text, json_object or json_schema; "
                           f"got {kind!r}", param="response_format")  # fmt: skip
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {key: value}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(n for n, _ in asked)
        raise APIError(400, f"use only one of response_format and guided_*; got {names}",
                       param=asked[1][0])  # fmt: skip
    name, kwargs = asked[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from e


def sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    aliases: dict[str, str] | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from the request; its own range checks become 400s naming the field."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.seed is not None and not -_INT64 <= req.seed < _INT64 - MAX_N:
        raise APIError(400, f"seed must fit in 64 bits, got {req.seed}", param="seed")
    if req.top_k is not None and req.top_k >= 2**31:
        raise APIError(400, f"top_k must be < 2**31, got {req.top_k}", param="top_k")
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(
                400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
            ) from None
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured=structured if structured is not None else structured_spec(req),
            kv_transfer_params=req.kv_transfer_params,
        )
    except ValueError as e:
        raise to_api_error(e, param_aliases=aliases) from e


def with_kv_transfer_params(body: dict[str, Any], output: RequestOutput) -> dict[str, Any]:
    """A response body with vLLM's `kv_transfer_params` where the KV connector returned some
    (a prefill worker's transfer handle, inferd/kv/connectors/pd)."""
    if output.kv_transfer_params is not None:
        body["kv_transfer_params"] = output.kv_transfer_params
    return body


async def add_requests(
    state: ServerState,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    texts: list[str] | None = None,
    stream: bool = True,
    timeout: float | None = None,
) -> list[RequestStream]:
    """Submit one engine request per prompt; all or none (a refusal aborts the ones accepted).

    `texts`: the prompts as the user wrote them, for the request log (ids are logged otherwise).
    `stream=False`: the response is built from the final outputs only.
    `timeout`: seconds from now until the requests are aborted with a 408 (stream_guards.py).
    """
    check_timeout(timeout)
    replicas = state.ready_replicas()
    streams: list[RequestStream] = []

    def count_timeout() -> None:  # once per request, on the replica of its first prompt
        replicas.supervisor_of(streams[0]).request_timeouts_total.inc()

    deadline = Deadline(timeout, count_timeout)

    async def submit(i: int) -> RequestStream:
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        state.log_request(rid, texts[i] if texts else prompts[i], params)
        accepted = await replicas.add_request(rid, prompts[i], params, priority, stream)
        deadline.arm(accepted)
        return accepted

    # The first window now (all or none); the rest as earlier ones end (fair_share.py).
    window = state.limits.max_concurrent_prompts
    try:
        for i in range(min(window, len(prompts))):
            streams.append(await submit(i))
    except BaseException as e:
        for accepted in streams:
            accepted.close()
        if isinstance(e, Exception):
            raise to_api_error(e, user_input=False) from e
        raise
    if len(prompts) > window:
        later = [functools.partial(submit, i) for i in range(window, len(prompts))]
        return share_window(streams, later)  # type: ignore[return-value]
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """Updates of several streams as they come, tagged with the stream's position.

    Closing the iterator (client gone) closes every stream, which aborts the unfinished requests.
    """
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for update in streams[0]:
                yield 0, update
        finally:
            streams[0].close()
        return
    # Bounded: a client that reads slowly leaves the updates in the streams, which bound them.
    queue: asyncio.Queue[tuple[int, RequestUpdate | BaseException | None]] = asyncio.Queue(
        len(streams)
    )

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for update in stream:
                await queue.put((i, update))
        except Exception as e:  # noqa: BLE001 — re-raised by the consumer below
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client hangs up first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its `finally` blocks abort the engine requests
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


def sse(data: dict[str, Any]) -> bytes:
    """One SSE event. orjson: ~10× faster than `json.dumps` here, and this runs per streamed
    token on the CPU the engine's last OpenMP worker shares. Like `ensure_ascii=False`, it writes
    UTF-8; a non-finite float (a -inf logprob) becomes null, where `json` wrote invalid JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes its engine streams however it ends.

    The body generator's own `finally` covers disconnects mid-stream, but a client that leaves
    before the first chunk cancels the response before the generator ever starts.
    """

    def __init__(self, body: AsyncIterator[bytes], streams: list[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        drop_client_on_overflow(scope, self._streams)
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


async def stream_with_errors(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame an SSE body: a failure mid-stream becomes an error event the client can read (the
    status line is already sent), and the stream always ends with `data: [DONE]`."""
    try:
        async for event in body:
            yield event
    except Exception as e:  # noqa: BLE001 — the status is sent; the client reads this event
        err = to_api_error(e, user_input=False)
        yield sse(
            error_body(err.status, err.message, param=err.param, code=err.code, type=err.type)
        )
    yield SSE_DONE
