"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

* `APIError` (and its subclasses) is what the serving code raises;
* `install_error_handlers(app)` maps pydantic / FastAPI validation errors to 400 with
  ``param`` naming the field, Starlette HTTP errors to the same shape (a path no route serves:
  404 naming the nearest served path, in Ollama's ``{"error": "..."}`` under /api/), and anything
  unexpected to 500;
* `engine_error_to_api_error` maps what the engine raises (dead, timed out, failed...) to its status.

The body guard that answers malformed requests before FastAPI is body_guard.py.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.engine.dp_client import ReplicaUnavailableError
from tokenloom.engine.request_errors import DuplicateRequestIdError, RequestFailedError, RequestTimeoutError
from tokenloom.engine.weight_updates import EngineAsleepError
from tokenloom.entrypoints.openai.route_suggest import not_found_message
from tokenloom.entrypoints.openai.server_state import ServerShuttingDownError

logger = logging.getLogger("tokenloom.server")

# How the engine names a LoRA adapter it refused for one request (tokenloom.lora.adapter.LoRAAdapterError).
_LORA_ERROR = "LoRAAdapterError: "


class APIError(Exception):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        if status_code is not None:
            self.status_code = status_code
        if error_type is not None:
            self.error_type = error_type

    def to_dict(self) -> JsonObject:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


class BadRequestError(APIError):
    status_code = 400


class AuthenticationError(APIError):
    status_code = 401
    error_type = "invalid_request_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class ServerError(APIError):
    status_code = 500
    error_type = "server_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "server_error"


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> JsonObject:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def engine_error_to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerShuttingDownError):
        return ServiceUnavailableError(str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return ServerError(str(exc), code="engine_dead")
    if isinstance(exc, EngineAsleepError):
        return ServiceUnavailableError(str(exc), code="engine_asleep", headers={"Retry-After": "10"})
    if isinstance(exc, ReplicaUnavailableError):
        return ServiceUnavailableError(str(exc), code="engine_unavailable", headers={"Retry-After": "10"})
    if isinstance(exc, DuplicateRequestIdError):
        return BadRequestError(str(exc), param="request_id", code="duplicate_request_id")
    if isinstance(exc, RequestFailedError) and str(exc).startswith(_LORA_ERROR):  # the adapter's files changed
        return BadRequestError(str(exc).removeprefix(_LORA_ERROR), param="model", code="invalid_lora_adapter")
    if isinstance(exc, RequestFailedError):
        return ServerError(f"the engine failed this request: {exc}", code="engine_error")
    if isinstance(exc, RequestTimeoutError):
        return APIError(str(exc), status_code=504, error_type="timeout_error", code="request_timeout")
    return ServerError(f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def error_response(status: int, message: str, error_type: str | None = None, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if error_type is None:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


# ------------------------------------------------------------------ validation errors

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _is_type_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def _param_path(loc: tuple[str | int, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union type tags are dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_type_tag(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _clean(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def validation_error_to_api_error(errors: list[ErrorDetails]) -> APIError:
    """Turn pydantic's error list into one readable 400 naming the first bad field."""
    if not errors:
        return BadRequestError("invalid request")
    first = errors[0]
    if first.get("type") in ("json_invalid", "json_type"):
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") or first.get("msg")
        return BadRequestError(f"request body is not valid JSON: {detail}", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    if loc == ("body",) and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return BadRequestError("request body must be a JSON object", code="invalid_json")
    param = _param_path(loc)
    if first.get("type") == "extra_forbidden":  # OpenAI's code and wording for a field it does not know
        return BadRequestError(f"Unrecognized request argument supplied: {param}", param=param,
                               code="unknown_parameter")
    top = loc[1] if len(loc) > 1 and loc[0] == "body" else (loc[0] if loc else None)
    same_field = [e for e in errors if len(e.get("loc", ())) > 1 and e["loc"][1] == top] if top else []
    tags = []
    for e in same_field:
        tag = next((p for p in e["loc"][2:] if _is_type_tag(p)), None)
        if tag and tag not in tags:
            tags.append(tag)
    if len(tags) > 1:
        message = f"{param or top}: expected one of {', '.join(tags)}"
    else:
        msg = _clean(str(first.get("msg", "invalid value")))
        message = f"{param}: {msg}" if param else msg
        if first.get("type") == "missing":
            message = f"{param}: field required"
    return BadRequestError(message, param=param, code="invalid_value" if first.get("type") != "missing"
                           else "missing_required_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return validation_error_to_api_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        if status == 404 and message == phrase:  # no route: name the nearest one (a handler's 404 says more)
            message = not_found_message(request.url.path, request.app.routes)
            if request.url.path.startswith("/api/"):
                return JSONResponse({"error": message}, status_code=404)
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(status)
        return error_response(status, message, code=code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")
