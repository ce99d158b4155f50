"""Registers the native APIs (Ollama's /api/*, llama-server's /completion and /props) on the app."""
from __future__ import annotations

from fastapi import FastAPI

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.native.llamacpp_routes import LlamaCppServing, register_llamacpp_routes
from tokenloom.entrypoints.native.ollama_routes import OllamaServing, register_ollama_routes
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding


def register_native_routes(app: FastAPI, engine: AsyncLLM, names: list[str], state: ServerState,
                           chat: OpenAIServingChat, completion: OpenAIServingCompletion,
                           embedding: OpenAIServingEmbedding) -> None:
    register_ollama_routes(app, OllamaServing(engine, names, state, chat, completion, embedding))
    register_llamacpp_routes(app, LlamaCppServing(engine, names, state, completion))
