"""The Messages API's routes: `register_messages_routes(app, ...)` adds them to the server's app."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.anthropic.errors import AnthropicErrorShapeMiddleware, AnthropicRoute
from tokenloom.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from tokenloom.entrypoints.anthropic.serving import AnthropicServingMessages
from tokenloom.entrypoints.openai.server_state import ServerState


def register_messages_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str], state: ServerState,
                             system_fingerprint: str) -> None:
    """POST /v1/messages and /v1/messages/count_tokens. Call it after the app's other middleware is added: the
    error-shape middleware must sit outside the API-key and body checks to give their answers Anthropic's shape.
    The `anthropic-version` and `anthropic-beta` headers are ignored; --api-key is also read from `x-api-key`."""
    messages = AnthropicServingMessages(engine, served_model_names, state, system_fingerprint)
    router = APIRouter(route_class=AnthropicRoute, tags=["anthropic"])

    @router.post("/v1/messages", response_model=None)
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(request, raw_request)

    @router.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(request: MessagesCountRequest) -> JsonObject:
        return await messages.count_tokens(request)

    app.include_router(router)
    app.add_middleware(AnthropicErrorShapeMiddleware)
