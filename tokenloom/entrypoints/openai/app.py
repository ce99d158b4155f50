"""The FastAPI application: routes, auth, body limits, CORS (closed by default), error shapes.

`build_app(engine, settings)` wires an already started `AsyncLLM` into a new app; the
server process (api_server.py) runs it under uvicorn. /docs and /redoc load their
JavaScript and CSS from the fastapi-offline package, so they work without internet.
"""
from __future__ import annotations

import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_fastapi_instrumentator import Instrumentator

import tokenloom
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.anthropic.routes import register_messages_routes
from tokenloom.entrypoints.native.routes import register_native_routes
from tokenloom.entrypoints.openai.batch.routes import register_batch_routes
from tokenloom.entrypoints.openai.body_guard import BodyGuardMiddleware
from tokenloom.entrypoints.openai.errors import NotFoundError, error_body, install_error_handlers
from tokenloom.entrypoints.openai.head_requests import HeadAsGetMiddleware
from tokenloom.entrypoints.openai.kv_trust import KVTrustMiddleware
from tokenloom.entrypoints.openai.lora_models import LoRAModels, register_lora_routes
from tokenloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenloom.entrypoints.openai.request_admission import AdmissionMiddleware
from tokenloom.entrypoints.openai.responses.routes import register_responses_routes
from tokenloom.entrypoints.openai.server_settings import ServerSettings
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenloom.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from tokenloom.entrypoints.openai.weight_routes import register_sleep_routes, register_weight_update_routes
from tokenloom.entrypoints.ui import PUBLIC_PATHS, PUBLIC_PREFIX, mount_ui
from tokenloom.exposure.cors import install_cors


class ApiKeyMiddleware:
    """Bearer-token check (constant-time compare) on every path but /health (/metrics included: its
    series name the models, the load and the request mix) and, with the web page on, the page and its
    static files (they hold no data; the page asks for the key and sends it with its API calls); answers
    401 in the OpenAI error shape."""

    def __init__(self, app, api_key: str, open_ui: bool = False) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = {"/health"}
        self.open_prefix = None
        if open_ui:
            self.open_paths |= PUBLIC_PATHS
            self.open_prefix = PUBLIC_PREFIX

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS"
                or (self.open_prefix and scope["path"].startswith(self.open_prefix))):
            return await self.app(scope, receive, send)
        token = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, rest = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    token = rest.strip()
            elif name.lower() == b"x-api-key" and not token:
                token = value.strip()
        if hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        message = "Incorrect API key provided." if token else "Missing API key: send 'Authorization: Bearer <key>'."
        body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLM, settings: ServerSettings, state: ServerState | None = None) -> FastAPI:
    state = state or ServerState()
    names = settings.served_model_names or [engine.served_model_name]
    fingerprint = settings.system_fingerprint or f"tokenloom-{tokenloom.__version__}"
    chat = OpenAIServingChat(engine, names, state, fingerprint)
    completion = OpenAIServingCompletion(engine, names, state, fingerprint)
    tokenization = OpenAIServingTokenization(engine, names, state, fingerprint)
    embedding = OpenAIServingEmbedding(engine, names, state, fingerprint)
    created = int(time.time())
    if state.lora_models is None:
        state.lora_models = LoRAModels(engine, names[0], engine.config.lora.enable_lora)
    lora_models = state.lora_models

    app = FastAPIOffline(title="tokenloom", version=tokenloom.__version__,
                         description="OpenAI-compatible API of the tokenloom inference engine.")
    app.state.engine = engine
    app.state.server_state = state
    install_error_handlers(app)
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(AdmissionMiddleware, state=state)
    app.add_middleware(KVTrustMiddleware, config=engine.config.kv_transfer_config)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_ui=settings.enable_ui)
    if engine.metrics is not None:  # http_requests_total, http_request_duration_seconds, ... as vLLM exposes
        Instrumentator(registry=engine.metrics.registry, excluded_handlers=["/metrics"]).instrument(app)
    install_cors(app, settings.cors)  # last, so outermost

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "tokenloom",
                "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await completion.create(request, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request):
        return await embedding.create(request, raw_request)

    register_responses_routes(app, engine, names, state, fingerprint)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names] + lora_models.cards(created)}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id in names:
            return model_card(model_id)
        card = next((c for c in lora_models.cards(created) if c["id"] == model_id), None)
        if card is None:
            raise NotFoundError(f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return card

    if settings.allow_runtime_lora_updating:
        register_lora_routes(app, lora_models, names)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return tokenization.detokenize(request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not engine.is_healthy:
            status = "engine_restarting" if getattr(engine, "restarting", False) else "engine_dead"
            return JSONResponse({"status": status, "reason": engine.dead_reason}, status_code=503)
        replicas = engine.replica_health()  # data parallel: serving while one replica is down is "degraded"
        if replicas is not None:
            degraded = not all(r["alive"] for r in replicas)
            return JSONResponse({"status": "degraded" if degraded else "ok", "engines": replicas})
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Admin: forget every cached prefix block (refused with 409 while requests hold blocks)."""
        if await engine.reset_prefix_cache():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"error": {"message": "the prefix cache cannot be reset while requests are running",
                                       "type": "conflict", "param": None, "code": "busy"}}, status_code=409)

    @app.get("/version")
    async def version():
        return {"version": tokenloom.__version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        m = engine.metrics
        if m is None:
            return Response(b"", media_type="text/plain")
        engine.update_engine_metrics()
        return Response(m.render(), media_type=m.content_type)

    register_native_routes(app, engine, names, state, chat, completion, embedding)

    register_messages_routes(app, engine, names, state, fingerprint)
    if settings.enable_ui:
        app.state.ui_status = mount_ui(app, engine, api_key_required=bool(settings.api_key))
    register_batch_routes(app, engine, settings.batch, state, names, fingerprint)
    if settings.enable_weight_updates:
        register_weight_update_routes(app, engine)
    if settings.enable_sleep_mode:
        register_sleep_routes(app, engine)
    return app
