"""Responses input items -> chat messages, the form the chat template renders.

An assistant turn is assembled from the items that make it: its reasoning (``reasoning_content``,
for templates that show it), its text and its function calls (``tool_calls``) join one assistant
message, as a chat client would send it; each ``function_call_output`` becomes a ``tool`` message
answering its ``call_id``. ``developer`` messages are system messages (OpenAI renamed the role;
chat templates know ``system``). ``instructions`` is a system message in front.
"""
from __future__ import annotations

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    PartList,
    ReasoningItem,
    part_text,
)


def _text(content: str | PartList, param: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _user_content(content: str | PartList, param: str) -> str | list[JsonValue]:
    """A message's content for the chat request: its text, or, when it carries images (`input_image`), chat
    content parts with `image_url` parts in their places."""
    if isinstance(content, str) or not any(part.get("type") == "input_image" for part in content):
        return _text(content, param)
    parts: list[JsonValue] = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise BadRequestError(f"{param}[{j}].image_url: an input_image part needs an image_url (a data: "
                                      f"URL, or http(s):// where the server allows it); file_id is not supported",
                                      param=f"{param}[{j}].image_url", code="invalid_value")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": part_text(part, f"{param}[{j}]")})
    return parts


def _reasoning_text(item: ReasoningItem, param: str) -> str:
    """The reasoning's full text when sent, else its summary."""
    if item.content:
        return _text(item.content, f"{param}.content")
    return "\n\n".join(part_text(part, f"{param}.summary[{j}]") for j, part in enumerate(item.summary))


def items_to_messages(items: list[InputItem], instructions: str | None = None,
                      field: str = "input") -> list[JsonObject]:
    """Chat messages for `items` (400 naming ``input[i]...`` for a part that is not text)."""
    messages: list[JsonObject] = [{"role": "system", "content": instructions}] if instructions else []
    turn: JsonObject | None = None  # the assistant turn being assembled

    def assistant() -> JsonObject:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(items):
        param = f"{field}[{i}]"
        if isinstance(item, MessageItem) and item.role == "assistant":
            msg = assistant()
            msg["content"] = f"{msg['content']}{_text(item.content, f'{param}.content')}"
        elif isinstance(item, FunctionCallItem):
            calls = assistant().setdefault("tool_calls", [])
            assert isinstance(calls, list)
            call: JsonValue = {"id": item.call_id, "type": "function",
                               "function": {"name": item.name, "arguments": item.arguments}}
            calls.append(call)
        elif isinstance(item, ReasoningItem):
            msg = assistant()
            msg["reasoning_content"] = f"{msg.get('reasoning_content') or ''}{_reasoning_text(item, param)}"
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{param}.output")})
        else:
            turn = None
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _user_content(item.content, f"{param}.content")})
    return messages
