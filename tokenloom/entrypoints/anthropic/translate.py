"""An Anthropic Messages request -> the chat completion request the chat machinery serves.

Blocks become chat messages the way chat templates expect them: the system prompt (a string or text
blocks) is one system message; an assistant turn's `tool_use` blocks are its `tool_calls` (arguments as
JSON text, as OpenAI clients send them) and its `thinking` blocks its `reasoning_content`; a user turn's
`tool_result` blocks are `tool` messages, in block order with the turn's text. Tools, tool_choice,
stop_sequences, sampling fields, `thinking` and `output_config.format` map to their chat equivalents, so
templates, tool-call parsing, reasoning, constraints and limits are the chat path's own.
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.anthropic.protocol import (
    Message,
    MessagesCountRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenloom.entrypoints.openai.errors import BadRequestError, validation_error_to_api_error
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest

# Text blocks of one turn are separate paragraphs; Anthropic's own models read them that way.
BLOCK_SEPARATOR = "\n\n"
# What a failed tool's result starts with (chat templates have no field for it).
TOOL_ERROR_PREFIX = "Error: "


def _block_error(i: int, j: int, message: str) -> BadRequestError:
    return BadRequestError(f"messages[{i}].content[{j}]: {message}", param=f"messages[{i}].content[{j}]",
                           code="invalid_value")


def _assistant_message(i: int, message: Message) -> JsonObject:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[JsonValue] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            raise _block_error(i, j, "tool_result blocks belong in user turns")
        # redacted_thinking: opaque to any model but Anthropic's; dropped
    out: JsonObject = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if reasoning:
        out["reasoning_content"] = BLOCK_SEPARATOR.join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _user_messages(i: int, message: Message) -> list[JsonObject]:
    out: list[JsonObject] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
            texts.clear()

    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            flush()
            content = (TOOL_ERROR_PREFIX if block.is_error else "") + block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise _block_error(i, j, f"{block.type} blocks belong in assistant turns")
    flush()
    return out or [{"role": "user", "content": ""}]


def chat_messages(request: MessagesCountRequest) -> list[JsonObject]:
    """The system prompt and the turns as chat messages."""
    out: list[JsonObject] = []
    system = request.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        if message.role == "assistant":
            out.append(_assistant_message(i, message))
        else:
            out.extend(_user_messages(i, message))
    return out


def _tool_fields(request: MessagesCountRequest) -> JsonObject:
    fields: JsonObject = {}
    if request.tools:
        tools: list[JsonValue] = []
        for tool in request.tools:
            function: JsonObject = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is None or (not request.tools and choice.type in ("auto", "none")):
        return fields
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _thinking_fields(request: MessagesCountRequest, reasoning_parser: bool) -> JsonObject:
    """`thinking` as the template's `enable_thinking` and a thinking budget, when the server splits reasoning
    (without a reasoning parser the model's thoughts could not be told from its answer: ignored)."""
    thinking = request.thinking
    if thinking is None or not reasoning_parser:
        return {}
    fields: JsonObject = {"chat_template_kwargs": {"enable_thinking": thinking.type != "disabled"}}
    if thinking.type != "disabled" and thinking.budget_tokens is not None:
        fields["thinking_token_budget"] = thinking.budget_tokens
    return fields


def _prefilled(request: MessagesCountRequest) -> bool:
    """A final assistant turn with text is a prefill: the answer continues it (Anthropic's behaviour)."""
    last = request.messages[-1]
    return last.role == "assistant" and any(isinstance(b, TextBlock) and b.text for b in last.content) \
        and not any(isinstance(b, ToolUseBlock) for b in last.content)


def to_chat_request(request: MessagesCountRequest, reasoning_parser: bool = False) -> ChatCompletionRequest:
    """The chat completion request that generates this Messages request's answer (or counts its prompt)."""
    body: JsonObject = {"model": request.model, "messages": chat_messages(request),
                        **_tool_fields(request), **_thinking_fields(request, reasoning_parser)}
    if _prefilled(request):
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    output_format = request.output_config.format if request.output_config is not None else None
    if output_format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": output_format.json_schema}}
    if isinstance(request, MessagesRequest):
        body.update({"max_tokens": request.max_tokens, "stop": request.stop_sequences,
                     "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
                     "stream": request.stream})
        if request.metadata is not None and request.metadata.user_id is not None:
            body["user"] = request.metadata.user_id
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api_error(list(e.errors())) from None
