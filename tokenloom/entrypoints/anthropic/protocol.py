"""Request bodies of Anthropic's Messages API (pydantic), with the same size limits as the chat API.

Field names and shapes follow Anthropic's (`anthropic.types.MessageCreateParams`): content as a string
or a list of blocks (`text`, `tool_use`, `tool_result`, `thinking`, `redacted_thinking`); other block
types (images, documents) are refused by the block type, since the engine serves text models. Inside
blocks, fields a local engine cannot act on (`cache_control`, `citations`) are ignored; at the top
level an unknown field is a 400 naming it, as Anthropic's API answers (`container`, `mcp_servers`
and the other server-side features among them), and `service_tier` is accepted (one tier here).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from tokenloom.entrypoints.openai.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP

MAX_ID_LEN = 256
MAX_NAME_LEN = 256
MAX_TOOLS = 1024


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ------------------------------------------------------------------ content blocks

class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=MAX_ID_LEN)
    name: str = Field(..., min_length=1, max_length=MAX_NAME_LEN)
    input: dict[str, JsonValue]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=MAX_ID_LEN)
    content: Union[str, Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)]] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(..., max_length=MAX_CONTENT_PARTS)

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_text_block(cls, v: object) -> object:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v


# ------------------------------------------------------------------ tools, thinking, output format

class Tool(AnthropicModel):
    # Server tools (web search, code execution, bash...) have their own types and run at Anthropic: refused here.
    type: Optional[Literal["custom"]] = None
    name: str = Field(..., min_length=1, max_length=MAX_NAME_LEN)
    description: Optional[str] = None
    input_schema: dict[str, JsonValue]


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, min_length=1, max_length=MAX_NAME_LEN)
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_needs_a_name(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


class ThinkingConfig(AnthropicModel):
    # "adaptive" (the model decides how long to think) is taken as "enabled" with no budget.
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, JsonValue] = Field(..., alias="schema")


class OutputConfig(AnthropicModel):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = Field(None, max_length=64)


class Metadata(AnthropicModel):
    user_id: Optional[str] = Field(None, max_length=1024)


# ------------------------------------------------------------------ requests

class MessagesCountRequest(AnthropicModel):
    """POST /v1/messages/count_tokens: what the prompt is made of (no sampling fields)."""

    # As Anthropic's API: an unknown top-level field is a 400 naming it, and "5" is not an int.
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    model: str = Field(..., min_length=1, max_length=1024)
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None

    @field_validator("system")
    @classmethod
    def _check_system(cls, v: Optional[Union[str, list[TextBlock]]]) -> Optional[Union[str, list[TextBlock]]]:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} system blocks")
        return v

    def system_text(self) -> Optional[str]:
        if isinstance(self.system, list):
            return "\n\n".join(b.text for b in self.system) or None
        return self.system or None


class MessagesRequest(MessagesCountRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=MAX_STOP)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[Metadata] = None
    stream: bool = False
    service_tier: Optional[Literal["auto", "standard_only"]] = None  # one tier here: no effect

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v
