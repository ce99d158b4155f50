"""Ollama's API on the served model: /api/chat, /api/generate, /api/embed(dings), /api/tags, /api/show,
/api/ps, /api/version.

Each generation is an OpenAI request run by the /v1 handler (ollama_translate.py builds it,
ollama_responses.py shapes the answer); streams are NDJSON and on by default, as in Ollama. Errors
are Ollama's ``{"error": "..."}`` with the status /v1 would give.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import tokenloom
from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.native.native_errors import native_errors, ollama_error, parse_body
from tokenloom.entrypoints.native.ollama_models import OllamaModelCard
from tokenloom.entrypoints.native.ollama_protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaLegacyEmbeddingsRequest,
    OllamaShowRequest,
)
from tokenloom.entrypoints.native.ollama_responses import (
    chat_answer,
    chat_stream,
    embed_answer,
    generate_answer,
    generate_stream,
    load_answer,
)
from tokenloom.entrypoints.native.ollama_translate import chat_request, embed_request, generate_request, served_name
from tokenloom.entrypoints.native.relay import GenerationTimer, call_openai, stream_openai
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenloom.entrypoints.openai.streaming import DisconnectAwareStreamingResponse, run_cancellable

# The Ollama release whose API this matches (tools, JSON-schema formats, think), for clients that gate
# features on /api/version.
OLLAMA_API_VERSION = "0.9.0"
NDJSON = "application/x-ndjson"


class OllamaServing:
    """The /api/* handlers over the /v1 ones."""

    def __init__(self, engine: AsyncLLM, names: list[str], state: ServerState, chat: OpenAIServingChat,
                 completion: OpenAIServingCompletion, embedding: OpenAIServingEmbedding) -> None:
        self.engine, self.names, self.state = engine, names, state
        self.chat, self.completion, self.embedding = chat, completion, embedding
        self.card = OllamaModelCard(engine, names)

    def _streamed(self, lines: AsyncIterator[str]) -> Response:
        return DisconnectAwareStreamingResponse(lines, media_type=NDJSON,
                                                write_timeout=self.state.stream_write_timeout)

    @staticmethod
    async def _whole(raw_request: Request, answer: Awaitable[JsonObject]) -> Response:
        body = await run_cancellable(raw_request, answer)
        return Response(status_code=499) if body is None else JSONResponse(body)

    async def handle_chat(self, raw_request: Request) -> Response:
        timer = GenerationTimer()
        request = await parse_body(OllamaChatRequest, raw_request)
        model = served_name(request.model, self.names)
        if not request.messages:
            return JSONResponse(load_answer(request.model, chat=True))
        events = await stream_openai(self.chat.create, chat_request(request, model), raw_request)
        if request.stream:
            return self._streamed(chat_stream(events, request.model, timer))
        return await self._whole(raw_request, chat_answer(events, request.model, timer))

    async def handle_generate(self, raw_request: Request) -> Response:
        timer = GenerationTimer()
        request = await parse_body(OllamaGenerateRequest, raw_request)
        model = served_name(request.model, self.names)
        if not request.prompt and not request.system:
            return JSONResponse(load_answer(request.model, chat=False))
        has_template = bool(self.engine.tokenizer is not None and self.engine.tokenizer.chat_template)
        translated = generate_request(request, model, has_template)
        handler = self.chat.create if isinstance(translated, ChatCompletionRequest) else self.completion.create
        events = await stream_openai(handler, translated, raw_request)
        if request.stream:
            return self._streamed(generate_stream(events, request.model, timer))
        return await self._whole(raw_request, generate_answer(events, request.model, timer))

    async def _embed(self, request: EmbeddingRequest, raw_request: Request) -> JsonObject | None:
        result = await call_openai(self.embedding.create, request, raw_request)
        assert result is None or isinstance(result, dict)
        return result

    async def handle_embed(self, raw_request: Request) -> Response:
        timer = GenerationTimer()
        request = await parse_body(OllamaEmbedRequest, raw_request)
        result = await self._embed(embed_request(request, served_name(request.model, self.names)), raw_request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(embed_answer(result, request.model, timer))

    async def handle_legacy_embeddings(self, raw_request: Request) -> Response:
        request = await parse_body(OllamaLegacyEmbeddingsRequest, raw_request)
        model = served_name(request.model, self.names)
        result = await self._embed(EmbeddingRequest(input=request.prompt, model=model), raw_request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse({"embedding": result["data"][0]["embedding"]})

    async def handle_show(self, raw_request: Request) -> Response:
        request = await parse_body(OllamaShowRequest, raw_request)
        name = request.model or request.name
        if not name:
            raise BadRequestError("model is required", param="model", code="missing_required_parameter")
        return JSONResponse(self.card.show(served_name(name, self.names)))


def register_ollama_routes(app: FastAPI, serving: OllamaServing) -> None:
    @app.post("/api/chat", tags=["ollama"])
    async def ollama_chat(raw_request: Request):
        """Ollama's chat: messages, tools, format, options; NDJSON stream unless ``stream: false``."""
        return await native_errors(ollama_error, serving.handle_chat(raw_request))

    @app.post("/api/generate", tags=["ollama"])
    async def ollama_generate(raw_request: Request):
        """Ollama's generate: prompt (and system) through the chat template, or ``raw``."""
        return await native_errors(ollama_error, serving.handle_generate(raw_request))

    @app.post("/api/embed", tags=["ollama"])
    async def ollama_embed(raw_request: Request):
        return await native_errors(ollama_error, serving.handle_embed(raw_request))

    @app.post("/api/embeddings", tags=["ollama"])
    async def ollama_embeddings(raw_request: Request):
        """Ollama's older embedding endpoint: one prompt -> ``embedding``."""
        return await native_errors(ollama_error, serving.handle_legacy_embeddings(raw_request))

    @app.post("/api/show", tags=["ollama"])
    async def ollama_show(raw_request: Request):
        return await native_errors(ollama_error, serving.handle_show(raw_request))

    @app.get("/api/tags", tags=["ollama"])
    async def ollama_tags():
        return serving.card.tags()

    @app.get("/api/ps", tags=["ollama"])
    async def ollama_ps():
        return serving.card.running()

    @app.get("/api/version", tags=["ollama"])
    async def ollama_version():
        return {"version": OLLAMA_API_VERSION, "tokenloom": tokenloom.__version__}
