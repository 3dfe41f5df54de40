"""The one place where failures become OpenAI-style error bodies `{"error": {message, type, param, code}}` with
their HTTP status: moelane's own errors, FastAPI's validation errors (400, not 422), unknown routes, and anything
unexpected (500, logged, without internals in the body).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from moelane.errors import InputError, MoelaneError, Unavailable
from moelane.server.generation import EngineError, RequestTimeout, ServerStopping
from moelane.server.protocol import FieldError
from moelane.server.responses import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)
INVALID = "invalid_value"  # the error code of a bad value, as OpenAI's


class ModelNotFound(MoelaneError):
    """The request names a model this server does not serve."""


class Overloaded(MoelaneError):
    """The admission queue is full."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientGone(MoelaneError):
    """The client disconnected before its reply was ready (answered with 499, which nobody reads)."""


# (status, type, code) per error class; the first match in this order wins.
ERROR_KINDS: tuple[tuple[type[Exception], int, str, str | None], ...] = (
    (ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (Overloaded, 429, "rate_limit_error", "queue_full"),
    (ServerStopping, 503, "server_error", "server_stopping"),
    (ClientGone, 499, "invalid_request_error", "client_closed_request"),
    (RequestTimeout, 504, "timeout_error", "timeout"),
    (Unavailable, 503, "server_error", "service_unavailable"),
    (EngineError, 500, "server_error", "engine_error"),
    (InputError, 400, "invalid_request_error", None),
    (MoelaneError, 400, "invalid_request_error", None),
)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def describe(exc: Exception) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for any exception; an error's own `param` and `code` attributes, where it
    has them, name the field and say which kind of bad value it is (`context_length_exceeded`, ...)."""
    for cls, status, type_, code in ERROR_KINDS:
        if isinstance(exc, cls):
            param, code = getattr(exc, "param", None), getattr(exc, "code", None) or code
            return status, error_body(str(exc), type_, param, code)
    log.error("unexpected error while serving a request", exc_info=exc)
    return 500, error_body("internal server error", "server_error", None, "internal_error")


def sse_event(body: dict[str, Any]) -> str:
    """An error body as one server-sent event, for failures after a stream has started."""
    return f"data: {json.dumps(body)}\n\n"


UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # pydantic's names of union members


def _is_field(part: object) -> bool:
    """Whether a pydantic error location part names a field or an index, not a union member it tried
    (`str`, `list[int]`, `function-after[...]`, a model's class name)."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text not in UNION_TAGS and not any(c in text for c in "[-") and not text[:1].isupper()


def validation_message(exc: RequestValidationError, content_type: str = "application/json") -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # the deepest: of a union's members' errors, that of the member the value was meant as ([1] for list[str])
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    parts = [str(p) for p in first.get("loc", ())]
    # (a tagged union's member is named by its tag, after the union: `tool_choice.tagged-union[...].function`)
    loc = [p for i, p in enumerate(parts) if _is_field(p) and not (i and parts[i - 1].startswith("tagged-union["))]
    if isinstance(found := (first.get("ctx") or {}).get("error"), FieldError):  # a model validator's, of one field
        loc.append(found.field)
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if param is None and "json" not in content_type.lower():
        return f"the request body must be JSON sent as Content-Type: application/json (got {content_type!r})", None
    if param is None and first.get("type") == "missing":
        return "the request body is empty; it must be a JSON object", None
    if param is None and first.get("type") == "model_attributes_type":  # (valid JSON, but not an object)
        return f"the request body must be a JSON object, not {json_kind(first.get('input'))}", None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # (our validators' words, without pydantic's "Value error, ")
        msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def unreadable_json(cause: BaseException | None) -> str | None:
    """Why a body that is not JSON by the letter failed to parse (FastAPI answers those with a bare "There was an
    error parsing the body"): bytes that are not UTF-8, nesting deeper than Python's reader goes."""
    if isinstance(cause, UnicodeDecodeError):
        return f"not UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "nested too deeply"
    return None


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words ("an array", "a string", ...)."""
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null" if value is None else "that")


MAX_BODY_BYTES = 64 << 20  # room for 128 prompts each filling a long context; a bigger body is refused unread


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before the server holds it in memory, by its
    `Content-Length` when it has one, else as its chunks arrive."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"the request body is larger than this server takes ({self.limit} bytes)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            body = error_body(message, "invalid_request_error", None, "request_too_large")
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > self.limit:  # raised inside FastAPI's body read, which re-raises HTTPException as is
                raise HTTPException(413, message)
            return event

        await self.app(scope, limited, send)


def install(app: FastAPI, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Register the handlers and the body limit on `app`."""
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(MoelaneError)
    async def _moelane(request: Request, exc: MoelaneError) -> JSONResponse:
        status, body = describe(exc)
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc, request.headers.get("content-type", ""))
        return JSONResponse(error_body(message, "invalid_request_error", param, INVALID), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and (why := unreadable_json(exc.__cause__)):  # FastAPI's "error parsing the body"
            body = error_body(f"the request body is not valid JSON ({why})", "invalid_request_error", None, INVALID)
            return JSONResponse(body, status_code=400)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "request_too_large" if exc.status_code == 413 else None  # (BodyLimit's, for a body sent in chunks)
        return JSONResponse(error_body(str(exc.detail), type_, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # fmt: skip

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        status, body = describe(exc)
        return JSONResponse(body, status_code=status)
