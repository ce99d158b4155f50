"""POST /tokenize and POST /detokenize (vLLM-compatible shapes).

Same input limits as generation (prompt characters, messages, chat template trust) and the
work runs off the event loop: a large prompt never pauses other requests' streams.
"""
from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.input_processor import encode_text
from tokenloom.entrypoints.openai.errors import BadRequestError, NotFoundError
from tokenloom.entrypoints.openai.limits import check_request_limits, check_text
from tokenloom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def tokenize(self, request: TokenizeRequest) -> JSONResponse:
        self._check_model(request.model)
        check_text(request)
        check_request_limits(request, self.engine.max_model_len)
        if request.messages is not None:
            _, ids = await self.render_prompt_async(request)
        else:
            ids = await asyncio.to_thread(encode_text, self.tokenizer, request.prompt or "",
                                          request.add_special_tokens)
        body: JsonObject = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if request.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        # A JSONResponse, not a dict: FastAPI's jsonable_encoder walks a returned dict item by item on the
        # event loop (~1 s for a dozen 26,000-token answers here); json.dumps of plain ints is C code.
        return JSONResponse(body)

    def detokenize(self, request: DetokenizeRequest) -> JsonObject:
        self._check_model(request.model)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in request.tokens if t >= vocab]
        if bad:
            raise BadRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens",
                                  code="invalid_value")
        return {"prompt": self.tokenizer.decode(list(request.tokens), skip_special_tokens=False)}
