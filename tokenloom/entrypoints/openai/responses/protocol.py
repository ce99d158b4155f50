"""Request bodies of POST /v1/responses (pydantic), with size limits, in the shapes of the `openai`
package's `types/responses/` (what OpenAI's SDKs send).

`input` items and `tools` arrive as JSON objects and are validated one by one by `parse_input_items`
and `parse_tools` through a type -> model table, so an error names the exact place
(``input[2].call_id``, ``tools[0].type``) and an item type tokenloom does not serve is a 400 saying so.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.openai.errors import BadRequestError, validation_error_to_api_error
from tokenloom.entrypoints.openai.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_REQUEST_ID_LEN

# OpenAI's own metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# As many tools as a chat request may carry.
MAX_TOOLS = 1024
# Names and ids the model or the client writes: far longer than any real one, short enough to log.
MAX_NAME_CHARS = 256


class _Model(BaseModel):
    # Unknown fields are ignored (as OpenAI-compatible servers do), never an error.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ------------------------------------------------------------------ input items

PartList = Annotated[list[dict[str, JsonValue]], Field(max_length=MAX_CONTENT_PARTS)]


class MessageItem(_Model):
    """A message: ``{"role", "content"}`` (an easy input message) or ``{"type": "message", ...}``; an
    assistant message sent back from an earlier response's output has ``output_text`` parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, PartList]
    id: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_shape(cls, v: object) -> object:
        if not isinstance(v, (str, list)) or any(not isinstance(part, dict) for part in v if isinstance(v, list)):
            raise ValueError("content must be a string or a list of content parts")
        return v


class FunctionCallItem(_Model):
    """A function call the model made, sent back so the conversation shows it."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str
    id: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)


class FunctionCallOutputItem(_Model):
    """The result of a function call, answering the call with the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    output: Union[str, PartList]
    id: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)


class ReasoningItem(_Model):
    """Reasoning from an earlier response's output (``summary`` and ``content`` text parts)."""

    type: Literal["reasoning"]
    summary: PartList = Field(default_factory=list)
    content: Optional[PartList] = None
    id: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
INPUT_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
# Text-bearing content parts, and the key holding their text.
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "reasoning_text": "text",
              "summary_text": "text"}


def located_error(e: ValidationError, prefix: tuple[str | int, ...]) -> BadRequestError:
    """A pydantic error of one nested object as the 400 the whole body would give, `param` naming the place."""
    errors = [{**err, "loc": ("body", *prefix, *err["loc"])} for err in e.errors()]
    return validation_error_to_api_error(errors)  # type: ignore[arg-type]


def part_text(part: JsonObject, param: str) -> str:
    """The text of a content part; 400 naming it for any other kind (images, files, audio)."""
    kind = part.get("type")
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise BadRequestError(f"{param}.type: content part type {kind!r} is not supported (text parts only: "
                              f"{', '.join(TEXT_PARTS)})", param=f"{param}.type", code="invalid_value")
    text = part.get(key)
    if not isinstance(text, str):
        raise BadRequestError(f"{param}.{key}: a {kind} part needs a string {key!r}", param=f"{param}.{key}",
                              code="invalid_value")
    return text


def parse_input_items(raw: list[JsonObject], field: str = "input") -> list[InputItem]:
    """Each item validated by the model its ``type`` names (``message`` when absent)."""
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        model = INPUT_ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise BadRequestError(f"{field}[{i}].type: item type {kind!r} is not supported; expected one of "
                                  f"{', '.join(INPUT_ITEM_TYPES)}", param=f"{field}[{i}].type", code="invalid_value")
        try:
            items.append(model.model_validate(item))
        except ValidationError as e:
            raise located_error(e, (field, i)) from None
    return items


# ------------------------------------------------------------------ tools and text format

class FunctionTool(_Model):
    """Responses' flat function tool: ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    description: Optional[str] = None
    parameters: Optional[dict[str, JsonValue]] = None
    strict: Optional[bool] = None


def parse_tools(raw: list[JsonObject]) -> list[FunctionTool]:
    tools = []
    for i, tool in enumerate(raw):
        if tool.get("type") != "function":
            raise BadRequestError(f"tools[{i}].type: tool type {tool.get('type')!r} is not supported (function "
                                  "tools only)", param=f"tools[{i}].type", code="invalid_value")
        try:
            tools.append(FunctionTool.model_validate(tool))
        except ValidationError as e:
            raise located_error(e, ("tools", i)) from None
    return tools


class TextFormat(_Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``name``, ``schema``, ``strict``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, max_length=MAX_NAME_CHARS)
    schema_: Optional[dict[str, JsonValue]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Model):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(_Model):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


# ------------------------------------------------------------------ the request

class ResponsesRequest(_Model):
    # OpenAI's rules: an unknown field is a 400 naming it, and "5" is not an int (items keep their extras).
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    model: Optional[str] = Field(None, max_length=1024)
    input: Optional[Union[str, Annotated[list[dict[str, JsonValue]], Field(max_length=MAX_MESSAGES)]]] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(None, min_length=1, max_length=MAX_REQUEST_ID_LEN)
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, JsonValue]]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, JsonValue]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ReasoningConfig] = None
    metadata: Optional[dict[str, str]] = Field(None, max_length=MAX_METADATA_PAIRS)
    user: Optional[str] = Field(None, max_length=1024)
    truncation: Optional[Literal["auto", "disabled"]] = None
    # OpenAI's, without an effect on the output (bookkeeping, hints, and extra output tokenloom has none of).
    include: Optional[list[str]] = Field(None, max_length=64)
    prompt_cache_key: Optional[str] = Field(None, max_length=1024)
    safety_identifier: Optional[str] = Field(None, max_length=1024)
    service_tier: Optional[str] = Field(None, max_length=64)
    stream_options: Optional[dict[str, bool]] = Field(None, max_length=8)
    max_tool_calls: Optional[int] = Field(None, ge=1)  # counts built-in tool calls: none run here

    @field_validator("input", mode="before")
    @classmethod
    def _check_input_shape(cls, v: object) -> object:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError("input must be a string or a list of items")
        for i, item in enumerate(v if isinstance(v, list) else ()):
            if not isinstance(item, dict):
                raise ValueError(f"input[{i}] must be an item object (a message, function_call, ...)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice_shape(cls, v: object) -> object:
        if v is not None and v not in ("none", "auto", "required") and not isinstance(v, dict):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
        return v

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata values have at most {MAX_METADATA_VALUE_CHARS} characters")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not supported: send the request and wait, or stream it")
        return v

    def input_items(self) -> list[InputItem]:
        """`input` as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return parse_input_items(self.input)

    def function_tools(self) -> list[FunctionTool]:
        return parse_tools(self.tools or [])
