"""POST /tokenize and POST /detokenize (vLLM-compatible shapes)."""
from __future__ import annotations

from typing import Any

from tokenloom.entrypoints.openai.errors import BadRequestError, NotFoundError
from tokenloom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self._check_model(request.model)
        if request.messages is not None:
            _, ids = self.render_prompt(request)
        else:
            ids = self.tokenizer.encode(request.prompt or "", add_special_tokens=request.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if request.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return body

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(request.model)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in request.tokens if t >= vocab]
        if bad:
            raise BadRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens",
                                  code="invalid_value")
        return {"prompt": self.tokenizer.decode(list(request.tokens), skip_special_tokens=False)}
