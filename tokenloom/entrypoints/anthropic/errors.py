"""Anthropic's error shape on the Messages paths: ``{"type": "error", "error": {"type", "message"}}``.

Every failure on /v1/messages... answers in it, whatever raised it, without touching other paths:

* `AnthropicRoute`, the route class of these paths, turns what their handlers raise (validation
  errors, the chat machinery's `APIError`s, engine errors, anything unexpected) into that shape;
* `AnthropicErrorShapeMiddleware` rewrites the OpenAI-shaped answers of the layers in front of the
  routes (API key, body guard, admission, unknown method) on these paths only;
* `error_event` is the same error inside a stream (an ``error`` event).

The error type follows the status, as Anthropic's API sets it (400 invalid_request_error, 401
authentication_error, 404 not_found_error, 503 overloaded_error, 5xx api_error...).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.anthropic.stream_events import sse_event
from tokenloom.entrypoints.openai.errors import APIError, engine_error_to_api_error, validation_error_to_api_error

logger = logging.getLogger("tokenloom.server")

MESSAGES_PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> JsonObject:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def to_api_error(exc: BaseException) -> APIError:
    """What a Messages handler raised, as an APIError (status and message)."""
    if isinstance(exc, RequestValidationError):
        return validation_error_to_api_error(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.detail if isinstance(exc.detail, str) else "request failed", status_code=exc.status_code,
                        headers=dict(exc.headers) if exc.headers else None)
    err = engine_error_to_api_error(exc)
    if err.code == "internal_error":  # not an engine error the client can act on: a bug
        logger.error("unexpected error on a Messages request", exc_info=exc)
    return err


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(error_body(err.status_code, err.message), status_code=err.status_code, headers=err.headers)


def error_event(exc: BaseException) -> str:
    """The failure of a stream under way, as Anthropic's ``error`` event."""
    err = to_api_error(exc)
    return sse_event(("error", error_body(err.status_code, err.message)))


class AnthropicRoute(APIRoute):
    """A route whose every failure answers in Anthropic's error shape (validation errors included)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def answer_in_anthropic_shape(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error
                return error_response(exc)

        return answer_in_anthropic_shape


class AnthropicErrorShapeMiddleware:
    """On the Messages paths, rewrites OpenAI-shaped error bodies (``{"error": {"message", ...}}``) from the
    middleware in front of the routes into Anthropic's shape; everything else passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            return await self.app(scope, receive, send)
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _rewritten(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def _rewritten(status: int, body: bytes) -> bytes:
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or data.get("type") == "error" or not isinstance(data.get("error"), dict):
        return body
    message = data["error"].get("message")
    return json.dumps(error_body(status, message if isinstance(message, str) else "request failed")).encode()
