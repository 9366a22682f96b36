"""POST /v1/chat/completions: messages → the model's (sandboxed) chat template → text.

Streams follow OpenAI: every choice opens with a `{"role": "assistant", "content": ""}` delta, then
one chunk per text delta; the last one carries `finish_reason`; usage comes last when asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from inferd.engine.async_engine import RequestStream
from inferd.engine.outputs import RequestOutput
from inferd.loader.tokenizer import ChatTemplateError, Tokenizer
from inferd.scheduler.sequence import Logprob
from inferd.server.control_tokens import GuardedMessages, guard_messages
from inferd.server.errors import APIError, to_api_error
from inferd.server.input_checks import check_template_kwargs, check_tool_calls
from inferd.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    OtherPart,
    TopLogprob,
    UsageInfo,
    now_s,
    random_id,
)
from inferd.server.serving_common import (
    EngineStreamingResponse,
    ServerState,
    add_requests,
    check_length,
    encode,
    merge_streams,
    sampling_params,
    sse,
    with_kv_transfer_params,
    stream_with_errors,
    structured_spec,
    until_disconnected,
)
from inferd.structured.tool_parsers import CallStream, ToolParser
from inferd.structured.tools import (
    ToolError,
    check_tools,
    chosen,
    forced_call_spec,
    prepare_messages,
)

# SamplingParams' names for what the chat API calls otherwise (for the error's `param`).
_CHAT_ALIASES = {"logprobs": "top_logprobs"}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content only, parts joined by newlines."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            texts = []
            for part in m.content:
                if isinstance(part, OtherPart) and part.type == "text":
                    raise APIError(
                        400, f"messages[{i}]: a text content part needs `text`", param="messages"
                    )
                if isinstance(part, OtherPart):
                    raise APIError(
                        400,
                        f"messages[{i}]: content parts of type `{part.type}` are "
                        "not supported (this model takes text only)",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        # "developer" is OpenAI's newer name for "system"; templates only know the latter.
        d: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(m, key)
            if value is not None:
                d[key] = value
        out.append(d)
    return out


async def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    functions: dict[str, dict[str, Any]] | None = None,
    parser: ToolParser | None = None,
) -> list[int]:
    """The prompt's token ids; a template that fails, refuses the messages (its
    `raise_exception`) or escapes the sandbox is a 400 naming the reason.

    `functions` (the checked tools): a template that ignores `tools` gets them described, in
    `parser`'s call format, in the system message (or the first user message, for a template
    without a system role) instead, and past tool calls written into the assistant turns."""
    tok = state.tokenizer
    check_template_kwargs(extra)
    try:
        dicts = message_dicts(messages)
        check_tool_calls(dicts)
        # Control tokens spelled in content stay text (control_tokens.py), unless the flag says.
        guarded = GuardedMessages(dicts)
        if not state.allow_control_tokens_in_content:
            guarded = guard_messages(tok, dicts)
            dicts = guarded.messages
        kwargs = {"add_generation_prompt": add_generation_prompt, **(extra or {})}
        text = tok.apply_chat_template(dicts, tools=tools, **kwargs)
        has_calls = any(d.get("tool_calls") for d in dicts)
        if (functions or has_calls) and text == tok.apply_chat_template(dicts, **kwargs):
            parser = parser or state.tool_parser()
            text = _render_described(tok, dicts, functions or {}, parser, kwargs)
    except ChatTemplateError as e:
        raise to_api_error(e) from e
    # The template writes the special tokens (BOS included) itself.
    if guarded.replaced:
        return guarded.encode(tok, text)
    return await encode(tok, text, add_special_tokens=False)


def _render_described(
    tok: Tokenizer,
    dicts: list[dict[str, Any]],
    functions: dict[str, dict[str, Any]],
    parser: ToolParser,
    kwargs: dict[str, Any],
) -> str:
    """The prompt of a template that ignores tools, told about them: in a system message, or, if
    the template refuses the one added (Gemma has no system role), in the first user message."""
    described = prepare_messages(dicts, functions, parser)
    try:
        return tok.apply_chat_template(described, **kwargs)
    except ChatTemplateError:
        if not functions or dicts[:1] and dicts[0].get("role") == "system":
            raise  # the system message was the user's own: the refusal is theirs to see
        described = prepare_messages(dicts, functions, parser, system_role=False)
        return tok.apply_chat_template(described, **kwargs)


def _tools(req: ChatCompletionRequest) -> tuple[dict[str, dict[str, Any]], str]:
    """(functions by name, normalized tool_choice); 400 naming the problem."""
    try:
        functions = check_tools(req.tools)
        return functions, chosen(req.tool_choice, functions)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from e


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")


def _logprob_entries(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int
) -> list[ChatTokenLogprob]:
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        best = sorted((e for e in entry.values() if e.rank <= top), key=lambda e: e.rank)[:top]
        out.append(
            ChatTokenLogprob(
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token or "",
                        logprob=e.logprob,
                        bytes=list((e.decoded_token or "").encode()),
                    )
                    for e in best
                ],
            )
        )
    return out


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> Any:
    model = state.check_model(req.model)
    salt = state.admit(req, raw)
    _check_unsupported(req)
    functions, tool_choice = _tools(req)
    if tool_choice == "none":
        functions = {}
    structured = forced_call_spec(tool_choice, functions, req.parallel_tool_calls)
    if structured is not None and structured_spec(req) is not None:
        raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                       "response_format or guided_*", param="tool_choice")  # fmt: skip
    parser = state.tool_parser() if functions else None
    ids = await render_chat(
        state,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        tools=req.tools if functions else None,
        extra=req.chat_template_kwargs,
        functions=functions,
        parser=parser,
    )
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = check_length(len(ids), wanted, state.max_model_len, "messages")
    top = req.top_logprobs or 0
    params = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=top if req.logprobs else None,
        aliases=_CHAT_ALIASES,
        structured=structured,
    )
    params.cache_salt = salt
    params.lora_request = state.lora_request(model)
    if parser is not None and parser.needs_special_tokens:
        params.skip_special_tokens = False  # the call marker is a special token
    request_id = random_id("chatcmpl")
    created = now_s()
    streams = await add_requests(
        state,
        request_id,
        [ids],
        params,
        req.priority,
        [state.tokenizer.decode(ids, skip_special_tokens=False)],
        stream=bool(req.stream),
        timeout=req.timeout,
    )
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(
            request_id,
            created,
            model,
            req.n,
            streams[0],
            len(ids),
            include_usage,
            top if req.logprobs else None,
            functions,
            parser,
        )
        return EngineStreamingResponse(stream_with_errors(body), streams)
    output = await until_disconnected(raw, _collect(streams[0]))
    response = _response(
        request_id, created, model, output, top if req.logprobs else None, functions, parser
    )
    return JSONResponse(with_kv_transfer_params(response.model_dump(exclude_none=False), output))


async def _collect(stream: RequestStream) -> RequestOutput:
    async for _, update in merge_streams([stream]):
        if update.output is not None:
            return update.output
    raise RuntimeError("request stream ended without an output")


def _response(
    request_id: str,
    created: int,
    model: str,
    out: RequestOutput,
    top: int | None,
    functions: dict[str, dict[str, Any]] | None = None,
    parser: ToolParser | None = None,
) -> ChatCompletionResponse:
    choices = []
    for o in out.outputs:
        logprobs = None
        if top is not None and o.logprobs is not None:
            logprobs = ChatLogprobs(content=_logprob_entries(o.token_ids, o.logprobs, top))
        content, calls = parser.parse(o.text, functions) if functions and parser else (o.text, [])
        message = ChatResponseMessage(content=content)
        finish = o.finish_reason
        if calls:
            message.tool_calls = [c.to_openai() for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        choices.append(
            ChatChoice(
                index=o.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=o.stop_reason,
            )
        )
    completion = sum(len(o.token_ids) for o in out.outputs)
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=UsageInfo.of(
            len(out.prompt_token_ids), completion, out.metrics.num_cached_tokens if out.metrics else 0
        ),
    )


async def _stream(
    request_id: str,
    created: int,
    model: str,
    n: int,
    stream: RequestStream,
    num_prompt: int,
    include_usage: bool,
    top: int | None,
    functions: dict[str, dict[str, Any]] | None = None,
    parser: ToolParser | None = None,
) -> AsyncIterator[bytes]:
    base: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
    }
    if include_usage:
        base["usage"] = None

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish: str | None = None,
        stop_reason: int | str | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return sse({**base, "choices": [choice]})

    # The role goes first, for every choice, before any token exists (clients show it at once).
    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    num_completion = 0
    num_cached = 0
    # With tools: text from where a tool call may begin is held back until the choice ends; calls
    # then go out as `delta.tool_calls` fragments.
    calls_of: dict[int, CallStream] = {}
    async for _, update in merge_streams([stream]):
        if update.output is not None and update.output.metrics is not None:
            num_cached = update.output.metrics.num_cached_tokens
        for d in update.deltas:
            num_completion += len(d.new_token_ids)
            logprobs = None
            if top is not None and d.new_logprobs:
                logprobs = {
                    "content": [
                        e.model_dump()
                        for e in _logprob_entries(d.new_token_ids, d.new_logprobs, top)
                    ]
                }
            text_delta = d.text_delta
            if functions and parser is not None:
                calls_stream = calls_of.setdefault(d.index, CallStream(parser, functions))
                text_delta = calls_stream.feed(text_delta)
                if d.finish_reason is not None:
                    tail, calls = calls_stream.finish()
                    text_delta += tail
                    if calls:
                        if text_delta:
                            yield chunk(d.index, {"content": text_delta})
                        for i, call in enumerate(calls):
                            for piece in _tool_call_fragments(i, call):
                                yield chunk(d.index, {"tool_calls": [piece]})
                        finish = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
                        yield chunk(d.index, {}, logprobs, finish, d.stop_reason)
                        continue
            if not text_delta and d.finish_reason is None and logprobs is None:
                continue  # text held back (a possible stop string, a partial UTF-8 character)
            delta = {"content": text_delta} if text_delta or logprobs else {}
            yield chunk(d.index, delta, logprobs, d.finish_reason, d.stop_reason)
    if include_usage:
        usage = UsageInfo.of(num_prompt, num_completion, num_cached).model_dump()
        yield sse({**base, "choices": [], "usage": usage})


def _tool_call_fragments(index: int, call: Any) -> list[dict[str, Any]]:
    """A call as streamed deltas: id, type and name first, then the arguments in pieces."""
    head = {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}  # fmt: skip
    args = call.arguments
    step = max(8, len(args) // 4)
    pieces = [args[i : i + step] for i in range(0, len(args), step)]
    return [head] + [{"index": index, "function": {"arguments": p}} for p in pieces]
