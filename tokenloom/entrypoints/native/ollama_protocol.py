"""Request bodies of Ollama's API (pydantic), with the same size caps as the OpenAI bodies.

Unknown top-level fields are ignored, as Ollama does. `options` keeps Ollama's names: the ones the
engine has are typed here (a bad value is a 400 naming ``options.<name>``); any other option is kept
as an extra and ignored by the translation (Ollama ignores options it does not know, too).
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from tokenloom.entrypoints.openai.protocol import MAX_MESSAGES, MAX_STOP, MAX_TOKEN_LIST

# Options a request may carry, known or not (Ollama's Options has about 30).
MAX_OPTIONS = 64
MAX_TOOLS = 1024
MAX_IMAGES = 16
MAX_NAME_CHARS = 1024

FormatField = Optional[Union[Literal["", "json"], dict[str, JsonValue]]]


class OllamaBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class OllamaOptions(OllamaBaseModel):
    """Sampling options the engine has, under Ollama's names; the rest are extras (ignored)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    num_predict: Optional[int] = Field(None, ge=-2)  # -1: no limit, -2: fill the context
    stop: Optional[list[str]] = Field(None, max_length=MAX_STOP)
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    repeat_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)

    @model_validator(mode="after")
    def _few_extras(self):
        if len(self.model_extra or {}) > MAX_OPTIONS:
            raise ValueError(f"at most {MAX_OPTIONS} options")
        return self

    def ignored(self) -> list[str]:
        """The names of the options given that the engine has no use for."""
        return sorted(self.model_extra or {})


class OllamaFunctionCall(OllamaBaseModel):
    name: str = Field(..., max_length=MAX_NAME_CHARS)
    arguments: dict[str, JsonValue] = Field(default_factory=dict)


class OllamaToolCall(OllamaBaseModel):
    function: OllamaFunctionCall


class OllamaMessage(OllamaBaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None
    images: Optional[list[str]] = Field(None, max_length=MAX_IMAGES)
    tool_calls: Optional[list[OllamaToolCall]] = Field(None, max_length=MAX_TOOLS)
    tool_name: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)


class _Generation(OllamaBaseModel):
    """What /api/chat and /api/generate share."""

    model: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    format: FormatField = None
    options: Optional[OllamaOptions] = None
    stream: bool = True
    keep_alive: Optional[Union[float, str]] = None  # the model stays loaded: accepted, ignored
    think: Optional[Union[bool, str]] = None


class OllamaChatRequest(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: Optional[list[dict[str, JsonValue]]] = Field(None, max_length=MAX_TOOLS)


class OllamaGenerateRequest(_Generation):
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = Field(None, max_length=MAX_TOKEN_LIST)
    images: Optional[list[str]] = Field(None, max_length=MAX_IMAGES)


class OllamaEmbedRequest(OllamaBaseModel):
    model: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    input: Union[str, list[str]]  # at most serving_embedding.MAX_INPUTS items
    truncate: bool = True
    dimensions: Optional[int] = Field(None, ge=1)
    options: Optional[dict[str, JsonValue]] = Field(None, max_length=MAX_OPTIONS)
    keep_alive: Optional[Union[float, str]] = None


class OllamaLegacyEmbeddingsRequest(OllamaBaseModel):
    model: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    prompt: str
    options: Optional[dict[str, JsonValue]] = Field(None, max_length=MAX_OPTIONS)
    keep_alive: Optional[Union[float, str]] = None


class OllamaShowRequest(OllamaBaseModel):
    model: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)
    name: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)  # the older spelling
    verbose: bool = False
