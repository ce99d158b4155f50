"""The chat machinery's answer -> Anthropic's `message`: content blocks, stop reason, usage.

The chat output parser splits the text into reasoning, content and tool calls (OpenAI's message
fields); here they become `thinking`, `text` and `tool_use` blocks, in that order. A tool call's
arguments are JSON text; Anthropic's `input` is an object, so text that is not a JSON object (a
model that wrote a bare value) is kept under an `arguments` key rather than lost.
"""
from __future__ import annotations

import json
import uuid

from tokenloom.core.json_types import JsonObject, JsonValue

# Anthropic's ids: msg_..., toolu_...
MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
# The chat parser's tool-call ids (call_...), renamed to Anthropic's prefix.
CHAT_CALL_ID_PREFIX = "call_"


def message_id() -> str:
    return f"{MESSAGE_ID_PREFIX}{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    return TOOL_USE_ID_PREFIX + call_id.removeprefix(CHAT_CALL_ID_PREFIX)


def tool_input(arguments: str) -> JsonObject:
    """A tool call's JSON text -> the tool_use block's `input` object."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def tool_use_block(call: JsonValue) -> JsonObject:
    """One chat tool call ({"id", "function": {"name", "arguments"}}) as a tool_use block."""
    assert isinstance(call, dict) and isinstance(call.get("function"), dict)
    function = call["function"]
    assert isinstance(function, dict)
    arguments = function.get("arguments")
    return {"type": "tool_use", "id": tool_use_id(str(call.get("id") or "")), "name": function.get("name"),
            "input": tool_input(arguments if isinstance(arguments, str) else "")}


def content_blocks(message: JsonObject) -> list[JsonValue]:
    """A chat message (reasoning_content, content, tool_calls) as content blocks."""
    blocks: list[JsonValue] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        # The signature proves a thought came from Anthropic's model; a local model's has none.
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    content = message.get("content")
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        blocks.extend(tool_use_block(call) for call in calls)
    return blocks


def stop_reason(finish_reason: str | None, matched: str | int | None, used_tools: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason and matched stop string or token."""
    if finish_reason == "length":
        return "max_tokens", None
    if used_tools:
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> JsonObject:
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the prefix cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message_body(msg_id: str, model: str, content: list[JsonValue], reason: str | None, sequence: str | None,
                 usage_fields: JsonObject) -> JsonObject:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_fields}
