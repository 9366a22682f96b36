"""POST /v1/completions: prompts (text or token ids, one or many) → text, streamed or not.

A request with P prompts and n choices each becomes P engine requests; choice `p * n + i` is the
i-th output of prompt p, as OpenAI and vLLM number them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from inferd.engine.async_engine import RequestStream, RequestUpdate
from inferd.engine.outputs import RequestOutput
from inferd.scheduler.sequence import Logprob
from inferd.server.errors import APIError
from inferd.server.limits import num_prompts
from inferd.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
    until_disconnected,
)


async def _prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """Every prompt as token ids (strings tokenized with the model's BOS rule)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]  # one prompt given as token ids
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    tok = state.tokenizer
    out: list[list[int]] = []
    for item in items:
        ids = await encode(tok, item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        out.append(ids)
    return out


def _logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], offset: int
) -> CompletionLogprobs:
    """The legacy completions logprobs shape; `offset` is where this text starts in the choice."""
    lp = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        text = chosen.decoded_token or ""
        lp.tokens.append(text)
        lp.token_logprobs.append(chosen.logprob)
        lp.top_logprobs.append(
            {
                (e.decoded_token or ""): e.logprob
                for e in sorted(entry.values(), key=lambda e: e.rank)
            }
        )
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Any:
    model = state.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(
            400,
            "echo with logprobs needs prompt logprobs, which are not supported yet",
            param="echo",
        )
    salt = state.admit(req, raw, prompts=num_prompts(req.prompt))
    prompts = await _prompts(state, req)
    max_len = state.max_model_len
    max_tokens = min(check_length(len(ids), req.max_tokens, max_len) for ids in prompts)
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
    params.cache_salt = salt
    params.lora_request = state.lora_request(model)
    request_id = random_id("cmpl")
    created = now_s()
    texts = [req.prompt] if isinstance(req.prompt, str) else None
    streams = await add_requests(
        state, request_id, prompts, params, req.priority, texts, stream=bool(req.stream),
        timeout=req.timeout,
    )
    echoes = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(
            request_id,
            created,
            model,
            req.n,
            streams,
            prompts,
            echoes,
            include_usage,
            req.logprobs is not None,
        )
        return EngineStreamingResponse(stream_with_errors(body), streams)
    outputs = await until_disconnected(raw, _collect(streams))
    body = _response(request_id, created, model, req.n, outputs, echoes).model_dump()
    return JSONResponse(with_kv_transfer_params(body, outputs[0]))


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    outputs: list[RequestOutput | None] = [None] * len(streams)
    async for i, update in merge_streams(streams):
        if update.output is not None:
            outputs[i] = update.output
    assert all(o is not None for o in outputs)
    return outputs  # type: ignore[return-value]


def _response(
    request_id: str,
    created: int,
    model: str,
    n: int,
    outputs: list[RequestOutput],
    echoes: list[str],
) -> CompletionResponse:
    choices: list[CompletionChoice] = []
    num_prompt = num_completion = num_cached = 0
    for p, out in enumerate(outputs):
        num_prompt += len(out.prompt_token_ids)
        num_cached += out.metrics.num_cached_tokens if out.metrics else 0
        for o in out.outputs:
            num_completion += len(o.token_ids)
            logprobs = None
            if o.logprobs is not None:
                logprobs = _logprobs(o.token_ids, o.logprobs, len(echoes[p]))
            choices.append(
                CompletionChoice(
                    index=p * n + o.index,
                    text=echoes[p] + o.text,
                    logprobs=logprobs,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                )
            )
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=UsageInfo.of(num_prompt, num_completion, num_cached),
    )


async def _stream(
    request_id: str,
    created: int,
    model: str,
    n: int,
    streams: list[RequestStream],
    prompts: list[list[int]],
    echoes: list[str],
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    base: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
    }
    if include_usage:
        base["usage"] = None  # OpenAI: every chunk has the field, null but on the last one
    offsets: dict[int, int] = {}  # choice index → characters streamed so far (echo included)
    num_completion = num_cached = 0
    async for p, update in merge_streams(streams):
        num_completion += sum(len(d.new_token_ids) for d in update.deltas)
        if update.output is not None and update.output.metrics is not None:
            num_cached += update.output.metrics.num_cached_tokens
        for chunk in _chunks(p, n, update, echoes, offsets, want_logprobs):
            yield sse({**base, "choices": [chunk]})
    if include_usage:
        num_prompt = sum(len(ids) for ids in prompts)
        usage = UsageInfo.of(num_prompt, num_completion, num_cached).model_dump()
        yield sse({**base, "choices": [], "usage": usage})


def _chunks(
    p: int,
    n: int,
    update: RequestUpdate,
    echoes: list[str],
    offsets: dict[int, int],
    want_logprobs: bool,
) -> list[dict[str, Any]]:
    chunks = []
    for d in update.deltas:
        index = p * n + d.index
        has_logprobs = want_logprobs and bool(d.new_logprobs)
        if not d.text_delta and d.finish_reason is None and not has_logprobs:
            continue  # text held back (a possible stop string, a partial UTF-8 character)
        text = d.text_delta
        if index not in offsets:  # the choice's first chunk carries the echoed prompt
            text = echoes[p] + text
            offsets[index] = len(echoes[p])
        logprobs = None
        if has_logprobs:
            logprobs = _logprobs(d.new_token_ids, d.new_logprobs, offsets[index]).model_dump()
        offsets[index] += len(d.text_delta)
        chunks.append(
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
        )
    return chunks
