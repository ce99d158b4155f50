"""Errors and request bodies for the native APIs: each API answers in its own error shape.

The handlers here parse their bodies themselves (`parse_body`), so a malformed body is the same 400 that
/v1 answers, and any error, raised by the translation or by the OpenAI handler underneath, is turned
into the native shape by `native_errors` instead of OpenAI's.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.openai.errors import APIError, engine_error_to_api_error, validation_error_to_api_error

logger = logging.getLogger("tokenloom.server")

BodyModel = TypeVar("BodyModel", bound=BaseModel)
ErrorShape = Callable[[APIError], JsonObject]


def ollama_error(err: APIError) -> JsonObject:
    """Ollama's shape: ``{"error": "..."}``."""
    return {"error": err.message}


def llamacpp_error(err: APIError) -> JsonObject:
    """llama-server's shape: ``{"error": {"code", "message", "type"}}``."""
    kind = "invalid_request_error" if err.status_code < 500 else err.error_type
    if err.status_code == 404:
        kind = "not_found_error"
    return {"error": {"code": err.status_code, "message": err.message, "type": kind}}


async def parse_body(cls: type[BodyModel], raw_request: Request) -> BodyModel:
    """The request body as `cls`; a 400 naming the field when it is not."""
    try:
        return cls.model_validate_json(await raw_request.body())
    except ValidationError as e:
        raise validation_error_to_api_error(list(e.errors())) from None


async def native_errors(shape: ErrorShape, work: Awaitable[Response]) -> Response:
    """`work`'s response, or its error in `shape` with the same status (never a stack trace)."""
    try:
        return await work
    except Exception as e:  # noqa: BLE001 - every error becomes an answer in the API's shape
        err = engine_error_to_api_error(e)
        if err.code == "internal_error":
            logger.exception("unhandled error in a native API handler")
        return JSONResponse(shape(err), status_code=err.status_code, headers=err.headers)

