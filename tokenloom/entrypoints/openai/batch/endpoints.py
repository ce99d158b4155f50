"""The one table of what a batch line may call: URL -> (request body model, serving class).

A batch line is answered by the very handler that answers the HTTP route, called in process: the body is
validated with the route's pydantic model and passed to the serving object's `create` with a stand-in
`Request` whose only job is to report a disconnect when the batch is cancelled (so the engine aborts the
request, as it does for a client that hangs up). Adding an endpoint to batches is one line in
`BATCH_ENDPOINTS`, as long as its serving class takes the shared constructor and has a
`method(request, raw_request) -> Response` (its name in `BatchEndpoint.method`).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import Message

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.anthropic.protocol import MessagesRequest
from tokenloom.entrypoints.anthropic.serving import AnthropicServingMessages
from tokenloom.entrypoints.openai.errors import (
    APIError,
    engine_error_to_api_error,
    error_body,
    validation_error_to_api_error,
)
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest
from tokenloom.entrypoints.openai.responses.serving import OpenAIServingResponses
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing

# Status of an answer the batch did not get because it was cancelled (nginx's "client closed request").
CANCELLED_STATUS = 499


@dataclass(frozen=True)
class BatchEndpoint:
    request_model: type[BaseModel]
    serving: type[OpenAIServing]
    method: str = "create"  # the serving object's handler of one request


BATCH_ENDPOINTS: dict[str, BatchEndpoint] = {
    "/v1/chat/completions": BatchEndpoint(ChatCompletionRequest, OpenAIServingChat),
    "/v1/completions": BatchEndpoint(CompletionRequest, OpenAIServingCompletion),
    "/v1/embeddings": BatchEndpoint(EmbeddingRequest, OpenAIServingEmbedding),
    "/v1/responses": BatchEndpoint(ResponsesRequest, OpenAIServingResponses, "create_response"),
    "/v1/messages": BatchEndpoint(MessagesRequest, AnthropicServingMessages, "create_message"),
}


@dataclass
class HandlerAnswer:
    """What the route would have sent: its status and JSON body."""

    status_code: int
    body: JsonObject

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


def _stand_in_request(url: str, cancelled: asyncio.Event) -> Request:
    """A `Request` for a handler called in process: no body to read; `receive` blocks until the batch is
    cancelled and then reports the client's disconnect (see streaming.run_cancellable)."""
    async def receive() -> Message:
        await cancelled.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": url, "raw_path": url.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "scheme": "http", "server": None,
             "client": None, "root_path": ""}
    return Request(scope, receive)


def _answer_of(response: Response) -> HandlerAnswer:
    try:
        body = json.loads(bytes(response.body))
    except (AttributeError, ValueError):
        body = error_body("the request was cancelled" if response.status_code == CANCELLED_STATUS
                          else "the handler gave no JSON body", "server_error", None, "no_body")
    return HandlerAnswer(response.status_code, body if isinstance(body, dict) else {"value": body})


class EndpointCaller:
    """One serving object per table entry, built once; `call(url, body)` answers one batch line."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], state: ServerState,
                 system_fingerprint: str | None = None,
                 endpoints: dict[str, BatchEndpoint] | None = None) -> None:
        self.endpoints = endpoints if endpoints is not None else BATCH_ENDPOINTS
        self.servings: dict[str, Callable[[BaseModel, Request], Awaitable[Response]]] = {
            url: getattr(e.serving(engine, served_model_names, state, system_fingerprint), e.method)
            for url, e in self.endpoints.items()}

    async def call(self, url: str, body: JsonObject, *, priority: int | None = None,
                   cancelled: asyncio.Event | None = None) -> HandlerAnswer:
        """The route's answer to `body` (errors in the API's shape, never raised). `priority`, when given,
        is the least urgent of it and the body's own (the engine runs lower numbers first)."""
        handler = self.servings.get(url)
        if handler is None:
            err = APIError(f"url {url!r} is not supported; use one of {', '.join(self.endpoints)}", param="url",
                           code="invalid_url")
            return HandlerAnswer(err.status_code, err.to_dict())
        try:
            request = self.endpoints[url].request_model.model_validate(body)
            if getattr(request, "stream", False):
                raise APIError("stream is not available in a batch", param="stream", code="invalid_value")
            if priority is not None and hasattr(request, "priority"):
                request.priority = max(int(getattr(request, "priority")), priority)
            response = await handler(request, _stand_in_request(url, cancelled or asyncio.Event()))
        except ValidationError as e:
            err = validation_error_to_api_error(list(e.errors()))
            return HandlerAnswer(err.status_code, err.to_dict())
        except Exception as e:  # noqa: BLE001 - every failure becomes the API's error answer
            err = engine_error_to_api_error(e)
            return HandlerAnswer(err.status_code, err.to_dict())
        return _answer_of(response)
