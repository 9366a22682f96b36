"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every way a request can fail ends here, so a user error is never a 500 and no response ever carries
a stack trace (unexpected exceptions are logged server-side and answered with a generic message).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, ParamSpec, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineStepError,
    QueueFullError,
    StreamOverflowError,
)
from inferd.engine.core import RequestError
from inferd.loader.tokenizer import ChatTemplateError

logger = logging.getLogger("inferd.server")

P = ParamSpec("P")
R = TypeVar("R")


class APIError(Exception):
    """An error to answer with: status, message, and OpenAI's type/param/code fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`headers`: extra response headers (a 503's Retry-After)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers


def error_type(status: int) -> str:
    # The types the OpenAI API itself returns.
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or error_type(status),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, param=err.param, code=err.code, type=err.type),
        status_code=err.status,
        headers=err.headers,
    )


# Field names as SamplingParams says them → as the API calls them.
_PARAM_NAMES = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "prompt",
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "best_of",
}


def to_api_error(
    exc: BaseException, *, param_aliases: dict[str, str] | None = None, user_input: bool = True
) -> APIError:
    """Map engine-side exceptions onto API errors (anything unknown is a 500 without details).

    `user_input`: the exception came from checking the request (a plain ValueError is then the
    user's mistake); elsewhere only `RequestError` is.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), code="model_loading")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, StreamOverflowError):
        return APIError(503, str(exc), code="stream_overflow")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), param="messages", code="chat_template_error")
    if isinstance(exc, RequestError) or (user_input and isinstance(exc, ValueError)):
        message = str(exc)
        # SamplingParams and the engine start their messages with the offending field's name.
        first = message.split(" ", 1)[0].rstrip(":")
        param = first if first in _PARAM_NAMES else None
        if param is not None and param_aliases:
            param = param_aliases.get(param, param)
        if param is None and message.startswith("prompt"):
            param = "prompt"
        return APIError(400, message, param=param)
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def api_errors(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Route decorator: any exception leaves the handler as an `APIError`.

    An exception that reached Starlette's catch-all handler would still be answered, but then
    re-raised into the server, which logs it as a crash and drops the keep-alive connection.
    """

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(*args, **kwargs)
        except APIError:
            raise
        except Exception as e:
            raise to_api_error(e, user_input=False) from e

    return wrapper


def _validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if not loc and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    # pydantic reports each member of a union; the first field name is what the user wrote wrong.
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = err.get("msg", "invalid value")
    return (f"{where}: {msg}" if where else msg), param


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        ctx = next(e for e in errors if e.get("type") == "json_invalid").get("ctx") or {}
        return error_response(
            APIError(400, f"malformed JSON body: {ctx.get('error', 'invalid JSON')}")
        )
    if not errors:
        return error_response(APIError(400, "invalid request"))
    message, param = _validation_message(errors[0])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(APIError(400, message, param=param))


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    message = exc.detail if isinstance(exc.detail, str) else phrase
    response = error_response(APIError(exc.status_code, message))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(to_api_error(exc, user_input=False))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)
