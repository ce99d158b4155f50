"""A Responses request -> the ChatCompletionRequest that the chat machinery serves.

The fields map one to one: ``max_output_tokens`` -> ``max_completion_tokens``; flat function tools
``{"type": "function", "name", "parameters"}`` -> chat's ``{"type": "function", "function": {...}}``;
a named ``tool_choice`` ``{"type": "function", "name"}`` likewise; ``text.format`` (``json_schema``
with ``name``/``schema``/``strict``, ``json_object``) -> ``response_format``. Errors the chat side
raises name chat fields; `responses_param` renames them to the Responses field the client sent.
"""
from __future__ import annotations

import re

from pydantic import ValidationError

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.errors import APIError, BadRequestError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.responses.protocol import FunctionTool, ResponsesRequest, TextConfig, located_error

# Chat field (as a param path prefix) -> the Responses field it came from.
_PARAM_RENAMES = (
    (re.compile(r"^messages.*"), "input"),  # the chat message list does not index like the input items
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)
# The same renames inside an error's message.
_MESSAGE_RENAMES = ((re.compile(r"\bmessages(\[\d+\])?(\.[\w\[\]]+)?"), "input"),
                    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
                    (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"))


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, replacement in _PARAM_RENAMES:
        param, n = pattern.subn(replacement, param)
        if n:
            break
    return param


def in_responses_terms(error: APIError) -> APIError:
    """`error` (raised by the chat machinery) naming the Responses fields instead of chat's."""
    error.param = responses_param(error.param)
    for pattern, replacement in _MESSAGE_RENAMES:
        error.message = pattern.sub(replacement, error.message)
    return error


def chat_tools(tools: list[FunctionTool]) -> list[JsonValue] | None:
    if not tools:
        return None
    out: list[JsonValue] = []
    for tool in tools:
        fn: JsonObject = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        if tool.parameters is not None:
            fn["parameters"] = tool.parameters
        if tool.strict is not None:
            fn["strict"] = tool.strict
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, JsonValue] | None) -> JsonValue:
    """none | auto | required as they are; ``{"type": "function", "name"}`` -> chat's nested form."""
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
                              f"(hosted tools are not served), got type {choice.get('type')!r}",
                              param="tool_choice", code="invalid_value")
    return {"type": "function", "function": {"name": name}}


def chat_response_format(text: TextConfig | None) -> JsonValue:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise BadRequestError("text.format.schema is required for a json_schema format", param="text.format.schema",
                              code="missing_required_parameter")
    schema: JsonObject = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}
    return {"type": "json_schema", "json_schema": schema}


def to_chat_request(request: ResponsesRequest, messages: list[JsonObject]) -> ChatCompletionRequest:
    """The chat request for `request` over the conversation `messages` (400s name Responses fields)."""
    fields: dict[str, JsonValue] = {
        "model": request.model,
        "messages": list(messages),
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "user": request.user,
        "stream": request.stream,
        "tools": chat_tools(request.function_tools()),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": chat_response_format(request.text),
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise in_responses_terms(located_error(e, ())) from None
