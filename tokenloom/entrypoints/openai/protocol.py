"""Request bodies of the OpenAI-compatible API (pydantic), with size limits.

Field names follow OpenAI; the engine's extras (vLLM names) sit beside them in the
same body, with other engines' spellings as aliases (llama.cpp's ``grammar`` and
``json_schema``). Nothing is silently ignored: a field that is neither OpenAI's, vLLM's
nor an alias is a 400 naming it; a vLLM field tokenloom does not implement is accepted
only with its no-op value (`NOT_IMPLEMENTED`); an OpenAI field without an effect here is
one OpenAI documents as bookkeeping or a hint (metadata, store, service_tier...). Types are
strict, as OpenAI's (``"max_tokens": "5"`` is a 400). Ranges that do not depend on the
engine are checked here, so a bad value fails with a 400 whose ``param`` names the field;
limits set by the engine config (max n, max logprobs, stop list sizes...) are checked by
`SamplingParams.validate_limits`. The policy, field by field, is in docs/apis.md.

Responses are built as plain dicts by the serving classes (see serving_*.py).
"""
from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator, model_validator

# Hard caps on request shapes (the body size limit caps strings and everything else).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_PROMPTS = 256
MAX_STOP = 64
MAX_TOKEN_LIST = 65536
MAX_LOGIT_BIAS = 4096
MAX_BAD_WORDS = 1024
MAX_REQUEST_ID_LEN = 256


def _field_error(field: str, message: str):
    """A validation error located at `field` (so the 400 names it), from a model-level check."""
    from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

    return ValidationError.from_exception_data("request", [InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=(field,), input=None)])


# OpenAI's own metadata limits: 16 pairs.
MAX_METADATA_PAIRS = 16
# The int64 range of OpenAI's `seed`.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# vLLM request fields tokenloom does not implement: accepted with the value that does nothing (an unset
# field, an empty list or dict count as it too), any other value is a 400 naming the field.
NOT_IMPLEMENTED: dict[str, JsonValue] = {
    "use_beam_search": False, "length_penalty": 1.0, "truncate_prompt_tokens": None, "logits_processors": None,
    "vllm_xargs": None, "return_tokens_as_token_ids": False, "guided_whitespace_pattern": None,
    "mm_processor_kwargs": None, "media_io_kwargs": None, "prompt_embeds": None, "include_reasoning": True,
}
# OpenAI's fields for what no engine here serves: any value (an empty object asks for web search too) is a 400.
NOT_SERVED: dict[str, str] = {
    "audio": "audio output", "web_search_options": "web search",
    "functions": "the pre-tools function calling (send tools)", "function_call": "the pre-tools function calling "
    "(send tool_choice)",
}


class OpenAIBaseModel(BaseModel):
    # Unknown fields are a 400 naming them; "5" is not an int (OpenAI's rules).
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    # OpenAI's: random padding against length side channels; accepted, not sent (no effect on the content).
    include_obfuscation: Optional[bool] = None


TokenIds = list[int]
StopField = Optional[Union[str, list[str]]]


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = Field(None, max_length=1024)
    n: Optional[int] = Field(1, ge=1, le=1024)
    max_tokens: Optional[int] = Field(None, ge=1)
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopField = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Optional[str] = Field(None, max_length=1024)

    # ---- vLLM fields tokenloom does not implement (see NOT_IMPLEMENTED)
    use_beam_search: Optional[JsonValue] = None
    length_penalty: Optional[JsonValue] = None
    truncate_prompt_tokens: Optional[JsonValue] = None
    logits_processors: Optional[JsonValue] = None
    vllm_xargs: Optional[JsonValue] = None
    return_tokens_as_token_ids: Optional[JsonValue] = None
    guided_whitespace_pattern: Optional[JsonValue] = None
    # vLLM's choice of grammar backend: tokenloom has one, which serves every request.
    guided_decoding_backend: Optional[str] = Field(None, max_length=64)

    # ---- engine extras (vLLM names)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOP * 16)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: Optional[list[str]] = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: Optional[list[int]] = Field(None, max_length=MAX_TOKEN_LIST)
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    # The scheduler orders by it; a 64-bit range as vLLM's (larger values cannot be compared cheaply).
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: Optional[str] = Field(None, min_length=1, max_length=MAX_REQUEST_ID_LEN)
    return_token_ids: bool = False
    cache_salt: Optional[str] = Field(None, max_length=1024)
    # Data parallel (-dp N): run on this engine replica (0..N-1) instead of the one the server picks.
    data_parallel_rank: Optional[int] = Field(None, ge=0)
    # Prefill/decode disaggregation (vLLM's field): set by `tokenloom router --pd`, answered by a prefill instance.
    kv_transfer_params: Optional[dict[str, JsonValue]] = Field(None, max_length=16)
    # The request's own arguments for the server's --logits-processors (vLLM's field).
    vllm_xargs: Optional[dict[str, JsonValue]] = Field(None, max_length=64)
    # Seconds the request may wait and run in all (capped by --request-timeout); past it: 504.
    timeout: Optional[float] = Field(None, gt=0, le=86400)

    # ---- accepted for the structured-outputs issue (not acted on yet)
    response_format: Optional[dict[str, JsonValue]] = None
    structured_outputs: Optional[dict[str, JsonValue]] = None
    # Constraints (vLLM names; at most one per request, see entrypoints/openai/structured.py).
    guided_json: Optional[Union[str, dict[str, JsonValue]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, JsonValue]]] = None
    # llama.cpp's spellings: `grammar` is guided_grammar (GBNF), `json_schema` is guided_json.
    grammar: Optional[str] = None
    json_schema: Optional[Union[str, dict[str, JsonValue]]] = None
    # With --reasoning-parser: end the reasoning after this many tokens.
    thinking_token_budget: Optional[int] = Field(None, ge=0)
    reasoning_max_tokens: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _check_not_implemented(self):
        for name, noop in NOT_IMPLEMENTED.items():
            value = getattr(self, name, None)
            if value is not None and value != noop and value != [] and value != {}:
                raise _field_error(name, f"not supported by tokenloom (accepted only as {json.dumps(noop)})")
        for name, what in NOT_SERVED.items():
            if getattr(self, name, None) is not None:
                raise _field_error(name, f"tokenloom does not serve {what}")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty strings")
        elif isinstance(v, str) and not v:
            raise ValueError("stop must be a non-empty string")
        return v

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _check_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        if v is not None:
            for key, bias in v.items():
                if not key.isascii() or not key.isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _check_stream_only(self):
        # OpenAI and vLLM: stream_options only with stream=true; vLLM: prompt_logprobs is not streamed.
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise _field_error("prompt_logprobs", "prompt_logprobs is not available when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# ------------------------------------------------------------------ chat

class ChatMessage(OpenAIBaseModel):
    # Extra keys (name, tool_calls, tool_call_id, reasoning_content...) are kept for the template.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, JsonValue]]]] = None
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _check_parts(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_CONTENT_PARTS:
                raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts")
            for part in v:
                kind = part.get("type")
                if kind == "image_url":
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, dict) else image
                    if not isinstance(url, str) or not url:
                        raise ValueError("an image_url content part needs image_url.url, a string")
                    continue
                if kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported (only 'text' and 'image_url')")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
        return v

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.get("type") == "image_url" for part in self.content)

    def text_content(self) -> Optional[str]:
        """The text of the message (its image parts left out)."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content if part.get("type") == "text")
        return self.content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = Field(None, max_length=256 * 1024)
    chat_template_kwargs: Optional[dict[str, JsonValue]] = None

    tools: Optional[list[dict[str, JsonValue]]] = Field(None, max_length=1024)
    tool_choice: Optional[Union[str, dict[str, JsonValue]]] = None
    parallel_tool_calls: Optional[bool] = None
    # Passed to the chat template (as vLLM does), with vLLM's RAG `documents`.
    reasoning_effort: Optional[str] = Field(None, max_length=64)
    documents: Optional[list[dict[str, JsonValue]]] = Field(None, max_length=1024)
    # OpenAI's output modalities: text only here (audio output is not served).
    modalities: Optional[list[Literal["text"]]] = None

    # ---- OpenAI's, without an effect on the output (bookkeeping and hints, as OpenAI documents them)
    metadata: Optional[dict[str, str]] = Field(None, max_length=MAX_METADATA_PAIRS)
    store: Optional[bool] = None
    service_tier: Optional[str] = Field(None, max_length=64)
    prompt_cache_key: Optional[str] = Field(None, max_length=1024)  # the prefix cache needs no key
    safety_identifier: Optional[str] = Field(None, max_length=1024)
    prediction: Optional[dict[str, JsonValue]] = None  # a speed hint for predicted outputs
    verbosity: Optional[Literal["low", "medium", "high"]] = None

    # ---- vLLM's best_of has no chat form here (n samples are returned, not searched); the rest: NOT_IMPLEMENTED
    # and NOT_SERVED
    best_of: Optional[Literal[1]] = None
    audio: Optional[JsonValue] = None
    web_search_options: Optional[JsonValue] = None
    functions: Optional[JsonValue] = None
    function_call: Optional[JsonValue] = None
    include_reasoning: Optional[JsonValue] = None
    mm_processor_kwargs: Optional[JsonValue] = None
    media_io_kwargs: Optional[JsonValue] = None
    # vLLM's: tokenize the chat template's text with the tokenizer's special tokens added (off: the template
    # writes them).
    add_special_tokens: Literal[False] = False

    # Cross-field checks sit on the later field so that the error names it.
    @field_validator("continue_final_message")
    @classmethod
    def _check_continue(cls, v, info: ValidationInfo):
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt to false)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs to be true")
        return v

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------ completions

PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0)
    best_of: Optional[int] = Field(None, ge=1, le=1024)
    # vLLM's: the prompt is tokenized with the tokenizer's special tokens (BOS...), as before.
    add_special_tokens: Literal[True] = True
    prompt_embeds: Optional[JsonValue] = None  # not implemented (see NOT_IMPLEMENTED)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if isinstance(v[0], list):
                if len(v) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
                for ids in v:
                    if not ids:
                        raise ValueError("a token-id prompt must not be empty")
                    if len(ids) > MAX_TOKEN_LIST or any(t < 0 for t in ids):
                        raise ValueError("token-id prompts must be lists of ints >= 0")
            elif isinstance(v[0], str):
                if len(v) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            else:
                if len(v) > MAX_TOKEN_LIST or any(t < 0 for t in v):
                    raise ValueError("token-id prompts must be lists of ints >= 0")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported: tokenloom has no fill-in-the-middle mode")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v, info: ValidationInfo):
        n = info.data.get("n") or 1
        if v is not None and v < n:
            raise ValueError(f"best_of must be >= n ({n})")
        if v is not None and v > n and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


# ------------------------------------------------------------------ tokenize

class TokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = Field(None, max_length=1024)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = Field(None, max_length=256 * 1024)
    chat_template_kwargs: Optional[dict[str, JsonValue]] = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = Field(None, max_length=1024)
    tokens: list[int] = Field(..., max_length=MAX_TOKEN_LIST)

    @field_validator("tokens")
    @classmethod
    def _check_ids(cls, v):
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v
