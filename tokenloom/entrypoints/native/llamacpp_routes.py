"""llama-server's native endpoints on the served model: POST /completion and GET /props (its /health
is the server's own). The completion runs through the /v1/completions handler (llamacpp_translate.py
translates both ways); errors are llama-server's ``{"error": {"code", "message", "type"}}``."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import tokenloom
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.native.llamacpp_protocol import LlamaCppCompletionRequest
from tokenloom.entrypoints.native.llamacpp_translate import (
    completion_answer,
    completion_request,
    completion_stream,
    prompt_text,
    props,
)
from tokenloom.entrypoints.native.native_errors import llamacpp_error, native_errors, parse_body
from tokenloom.entrypoints.native.relay import GenerationTimer, stream_openai
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.streaming import DisconnectAwareStreamingResponse, run_cancellable


class LlamaCppServing:
    def __init__(self, engine: AsyncLLM, names: list[str], state: ServerState,
                 completion: OpenAIServingCompletion) -> None:
        self.engine, self.names, self.state, self.completion = engine, names, state, completion

    async def handle_completion(self, raw_request: Request) -> Response:
        timer = GenerationTimer()
        request = await parse_body(LlamaCppCompletionRequest, raw_request)
        model = self.names[0]
        prompt = prompt_text(request.prompt)
        events = await stream_openai(self.completion.create, completion_request(request, model), raw_request)
        if not request.stream:
            body = await run_cancellable(raw_request, completion_answer(events, model, prompt, timer))
            return Response(status_code=499) if body is None else JSONResponse(body)
        return DisconnectAwareStreamingResponse(completion_stream(events, model, prompt, timer),
                                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                                write_timeout=self.state.stream_write_timeout)

    def props(self) -> Response:
        tokenizer = self.engine.tokenizer
        return JSONResponse(props(self.names[0], self.engine.model_path or "", self.engine.max_model_len,
                                  self.engine.config.scheduler.max_num_seqs,
                                  (tokenizer.chat_template or "") if tokenizer is not None else "",
                                  self.engine.default_sampling_params(), f"tokenloom {tokenloom.__version__}"))


def register_llamacpp_routes(app: FastAPI, serving: LlamaCppServing) -> None:
    @app.post("/completion", tags=["llama.cpp"])
    async def llamacpp_completion(raw_request: Request):
        """llama-server's completion: prompt (text or token ids), n_predict, grammar, json_schema, stream."""
        return await native_errors(llamacpp_error, serving.handle_completion(raw_request))

    @app.get("/props", tags=["llama.cpp"])
    async def llamacpp_props():
        """llama-server's properties: default generation settings, slots, model path, context, template."""
        return serving.props()
