"""Ollama requests -> OpenAI requests (the pure half of the Ollama API; the answers are ollama_responses.py).

* `options`: the ones the engine has map onto the OpenAI/vLLM sampling fields (`OPTION_FIELDS`;
  ``num_predict`` -> ``max_tokens``, where -1, -2 and 0 mean no limit beyond the context); the others
  (``num_ctx``, ``mirostat``, ``num_gpu``...) are ignored with a debug log, as Ollama ignores unknown ones;
* `format`: ``"json"`` -> JSON mode, a schema -> structured outputs with that schema;
* messages: ``images`` are refused (text-only engine); ``tool_calls`` with object arguments and
  ``tool_name`` go to the chat template as OpenAI's fields; ``thinking`` as ``reasoning_content``;
* ``think`` -> the template's ``enable_thinking``.
"""
from __future__ import annotations

import logging

from pydantic import ValidationError

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.native.ollama_protocol import (
    FormatField,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
)
from tokenloom.entrypoints.openai.errors import BadRequestError, NotFoundError, validation_error_to_api_error
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.serving_embedding import EmbeddingRequest

logger = logging.getLogger("tokenloom.server")

# Ollama option -> the OpenAI / vLLM sampling field it sets.
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# The tag Ollama puts on a model name when none is given.
DEFAULT_TAG = ":latest"


def served_name(requested: str, names: list[str]) -> str:
    """The served model a request names (``name`` or ``name:latest``); 404 in Ollama's words otherwise."""
    for candidate in (requested, requested.removesuffix(DEFAULT_TAG)):
        if candidate in names:
            return candidate
    raise NotFoundError(f"model '{requested}' not found", param="model", code="model_not_found")


def sampling_fields(options: OllamaOptions | None) -> JsonObject:
    """The OpenAI sampling fields Ollama's options set; unknown options are logged and ignored."""
    if options is None:
        return {}
    out: JsonObject = {}
    for name, field in OPTION_FIELDS.items():
        value = getattr(options, name)
        if value is not None:
            out[field] = value
    if options.num_predict is not None and options.num_predict > 0:
        out["max_tokens"] = options.num_predict
    ignored = options.ignored()
    if ignored:
        logger.debug("Ollama options without an engine setting, ignored: %s", ", ".join(ignored))
    return out


def response_format(fmt: FormatField) -> JsonObject | None:
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    return None


def _think_kwargs(think: bool | str | None) -> JsonObject | None:
    if think is None:
        return None
    return {"enable_thinking": think is not False}


def openai_message(message: OllamaMessage, where: str) -> JsonObject:
    if message.images:
        raise BadRequestError("images are not supported: this server runs text-only models",
                              param=f"{where}.images", code="invalid_value")
    out: JsonObject = {"role": message.role, "content": message.content}
    if message.thinking:
        out["reasoning_content"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    if message.tool_name:
        out["name"] = message.tool_name
    return out


def _build(cls: type[ChatCompletionRequest] | type[CompletionRequest],
           body: JsonObject) -> ChatCompletionRequest | CompletionRequest:
    """The OpenAI request, validated as /v1 validates it (a bad value is the same 400)."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api_error(list(e.errors())) from None


def _common(request: OllamaChatRequest | OllamaGenerateRequest, model: str) -> JsonObject:
    # Streamed from the handler either way (see relay.py); usage for the final counts.
    body: JsonObject = {"model": model, **sampling_fields(request.options), "stream": True,
                        "stream_options": {"include_usage": True}}
    fmt = response_format(request.format)
    if fmt is not None:
        body["response_format"] = fmt
    kwargs = _think_kwargs(request.think)
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    return body


def chat_request(request: OllamaChatRequest, model: str) -> ChatCompletionRequest:
    """/api/chat -> /v1/chat/completions."""
    if not request.messages:
        raise BadRequestError("messages must hold at least one message", param="messages", code="invalid_value")
    messages: list[JsonValue] = [openai_message(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
    body = {**_common(request, model), "messages": messages}
    if request.tools:
        body["tools"] = list(request.tools)
    built = _build(ChatCompletionRequest, body)
    assert isinstance(built, ChatCompletionRequest)
    return built


def generate_request(request: OllamaGenerateRequest, model: str,
                     has_template: bool) -> ChatCompletionRequest | CompletionRequest:
    """/api/generate -> a chat request (the model's template around `system` and `prompt`), or, with
    ``raw`` or for a model without a chat template, a completion of the prompt as it is."""
    if request.suffix:
        raise BadRequestError("suffix is not supported: tokenloom has no fill-in-the-middle mode",
                              param="suffix", code="invalid_value")
    if request.context:
        raise BadRequestError("context is not supported: send the conversation to /api/chat instead",
                              param="context", code="invalid_value")
    if request.template:
        raise BadRequestError("template is not supported: the model's own chat template is used (or send "
                              "raw: true with the prompt already formatted)", param="template", code="invalid_value")
    if request.images:
        raise BadRequestError("images are not supported: this server runs text-only models", param="images",
                              code="invalid_value")
    body = _common(request, model)
    if request.raw or not has_template:
        prompt = request.prompt if request.system is None or request.raw else f"{request.system}\n\n{request.prompt}"
        body.pop("chat_template_kwargs", None)
        return _build(CompletionRequest, {**body, "prompt": prompt})
    messages: list[JsonValue] = [{"role": "user", "content": request.prompt}]
    if request.system is not None:
        messages.insert(0, {"role": "system", "content": request.system})
    return _build(ChatCompletionRequest, {**body, "messages": messages})


def embed_request(request: OllamaEmbedRequest, model: str) -> EmbeddingRequest:
    """/api/embed -> /v1/embeddings (floats)."""
    if request.options:
        logger.debug("Ollama options have no effect on embeddings, ignored: %s", ", ".join(sorted(request.options)))
    return EmbeddingRequest(input=request.input, model=model, encoding_format="float",
                            dimensions=request.dimensions)
