"""POST /v1/embeddings (OpenAI's shape): one embedding per input, each input one engine request.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; `encoding_format`
float (a list of numbers) or base64 (little-endian float32 bytes, as OpenAI's clients decode them);
`dimensions` truncates (and renormalizes) only where the model declares Matryoshka training, else 400.
Inputs are batched by the engine's scheduler with everything else (each is one prefill) and admitted like
any request. Limits: at most `MAX_INPUTS` inputs per request (OpenAI's), each within the model's context and
one engine step's token budget (400 `context_length_exceeded` naming the input otherwise).
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.load_estimator import PROMPT_TOKEN_WEIGHT
from tokenloom.entrypoints.openai.admission import Arrival
from tokenloom.entrypoints.openai.errors import BadRequestError, engine_error_to_api_error
from tokenloom.entrypoints.openai.formatting import random_id
from tokenloom.entrypoints.openai.limits import check_text
from tokenloom.entrypoints.openai.protocol import OpenAIBaseModel
from tokenloom.entrypoints.openai.request_admission import CHARS_PER_TOKEN_ESTIMATE
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing
from tokenloom.entrypoints.openai.streaming import merge_generators, run_cancellable
from tokenloom.model.pooling_config import truncate

# Inputs per request: OpenAI's limit for an array input.
MAX_INPUTS = 2048
# Total characters of text inputs tokenized on the event loop; more go to a thread (as long prompts do).
INLINE_TOKENIZE_CHARS = 4096


class EmbeddingRequest(OpenAIBaseModel):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None
    # vLLM's: inputs are tokenized with the tokenizer's special tokens (the only form served).
    add_special_tokens: Literal[True] = True

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list (400 when empty)."""
        value = self.input
        if isinstance(value, str):
            items: list = [value]
        elif value and isinstance(value[0], int):
            items = [list(value)]
        else:
            items = list(value)
        if not items or any(len(x) == 0 for x in items):
            raise BadRequestError("input must not be empty (nor hold an empty string or token list)", param="input",
                                  code="invalid_value")
        if len(items) > MAX_INPUTS:
            raise BadRequestError(f"input has {len(items)} items; at most {MAX_INPUTS} are allowed per request",
                                  param="input", code="invalid_value")
        return items


def _encode(embedding: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


class OpenAIServingEmbedding(OpenAIServing):

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_available()
        self.check_model(request.model)
        pooling = self.engine.pooling
        if pooling is None:
            raise BadRequestError("this model generates text and does not serve embeddings: serve an embedding "
                                  "model (e.g. all-minilm-l6-v2), or this one with --runner pooling (or "
                                  "--convert embed)", param="model", code="model_not_embedding")
        problem = pooling.check_dimensions(request.dimensions)
        if problem:
            raise BadRequestError(problem, param="dimensions", code="invalid_value")
        check_text(request)
        inputs = request.inputs()
        chars = sum(len(x) for x in inputs if isinstance(x, str))
        tokens = sum(len(x) for x in inputs if isinstance(x, list)) + chars // CHARS_PER_TOKEN_ESTIMATE
        self.admit_arrival(Arrival(seqs=len(inputs), tokens_per_seq=1,
                                   work=len(inputs) + tokens * PROMPT_TOKEN_WEIGHT))
        base_id = random_id("embd")
        params = SamplingParams(max_tokens=1, embed=True)

        def process_all():
            return [self.process_inputs(base_id if len(inputs) == 1 else f"{base_id}-{i}", x, params.clone(), 0,
                                        None, prompt_param="input" if len(inputs) == 1 else f"input[{i}]")
                    for i, x in enumerate(inputs)]

        requests = await asyncio.to_thread(process_all) if chars > INLINE_TOKENIZE_CHARS else process_all()
        reservation = self.reservation()
        gens = [self.engine.generate(x, er.sampling_params, er.request_id, engine_request=er, prompt_text="",
                                     reservation=reservation)
                for x, er in zip(inputs, requests)]
        result = await run_cancellable(raw_request, self._collect(request, gens, base_id))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result)

    async def _collect(self, request: EmbeddingRequest, gens, request_id: str) -> dict:
        finals = [None] * len(gens)
        try:
            async for i, out in merge_generators(gens):
                finals[i] = out
        except Exception as e:  # noqa: BLE001
            raise engine_error_to_api_error(e) from None
        pooling = self.engine.pooling
        data = []
        prompt_tokens = 0
        for i, ro in enumerate(finals):
            prompt_tokens += len(ro.prompt_token_ids)
            embedding = truncate(ro.embedding, request.dimensions, pooling)
            data.append({"object": "embedding", "index": i, "embedding": _encode(embedding, request.encoding_format)})
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.model_name,
                "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
