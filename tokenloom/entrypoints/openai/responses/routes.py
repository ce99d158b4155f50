"""The Responses API's routes: POST /v1/responses, GET and DELETE /v1/responses/{response_id}."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest
from tokenloom.entrypoints.openai.responses.serving import OpenAIServingResponses
from tokenloom.entrypoints.openai.responses.store import ResponseStore
from tokenloom.entrypoints.openai.server_state import ServerState


def register_responses_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str], state: ServerState,
                              system_fingerprint: str) -> OpenAIServingResponses:
    serving = OpenAIServingResponses(engine, served_model_names, state, system_fingerprint, ResponseStore())

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serving.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(serving.stored(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(serving.delete(response_id))

    return serving
