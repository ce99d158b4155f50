"""Chat-shaped output (reasoning_content, content, tool_calls) -> Responses output items, and the
``response`` object around them.

Items carry their own ids (``rs_``, ``msg_``, ``fc_``); a function call keeps the chat call's id as
its ``call_id``, which the client's ``function_call_output`` answers. A finish by length makes the
response ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` (OpenAI's reason;
the context running out ends it the same way) and its last item ``incomplete``.
"""
from __future__ import annotations

import uuid

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str, item_id: str | None = None) -> JsonObject:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text_part(text: str) -> JsonObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str, item_id: str | None = None) -> JsonObject:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def function_call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> JsonObject:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def status_of(finish_reason: str | None) -> str:
    """The response's status for the engine's finish reason."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: JsonObject, status: str) -> list[JsonObject]:
    """Items for one chat message (as ChatOutputParser.message builds it): reasoning, text, calls, in order.
    An answer with neither text nor calls is one empty message, as OpenAI gives."""
    items: list[JsonObject] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(reasoning, "completed"))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    assert isinstance(calls, list)
    if (isinstance(content, str) and content) or not calls:
        items.append(message_item(content if isinstance(content, str) else "", "completed"))
    for call in calls:
        assert isinstance(call, dict) and isinstance(call.get("function"), dict)
        fn = call["function"]
        assert isinstance(fn, dict)
        items.append(function_call_item(str(call["id"]), str(fn["name"]), str(fn["arguments"]), "completed"))
    if status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> JsonObject:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def response_object(request: ResponsesRequest, response_id: str, model: str, created_at: int, status: str,
                    output: list[JsonObject], usage_body: JsonObject | None = None,
                    error: JsonObject | None = None) -> JsonObject:
    """The ``response`` object: the output, and the request's settings echoed as OpenAI does."""
    tools: list[JsonValue] = [t.model_dump(exclude_none=True) for t in request.function_tools()]
    text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text else {"format": {"type": "text"}}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": None, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "model": model,
        "output": list(output), "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "store": request.store, "temperature": request.temperature, "text": text,
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": tools, "top_p": request.top_p, "truncation": request.truncation or "disabled",
        "usage": usage_body, "user": request.user, "metadata": request.metadata or {},
    }
