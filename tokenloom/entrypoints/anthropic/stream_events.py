"""Anthropic's stream of events for one message, from the chat output parser's deltas.

The order Anthropic's clients expect (and `anthropic`'s stream helper checks): ``message_start`` (and a
``ping``), then for each content block ``content_block_start``, its ``content_block_delta`` events
(``thinking_delta``, ``text_delta`` or ``input_json_delta``) and ``content_block_stop``, one block open
at a time, then ``message_delta`` (stop reason, usage) and ``message_stop``. A chat delta may carry
reasoning, content and tool-call pieces at once; they are taken in that order, a new block starting
whenever the kind (or the tool call) changes.
"""
from __future__ import annotations

import json

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.anthropic.blocks import message_body, tool_use_id, usage

Event = tuple[str, JsonObject]


def sse_event(event: Event) -> str:
    """One server-sent event with its `event:` line, as Anthropic frames them."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageEventStream:
    """The events of one streamed message; `start`, then `feed` per chat delta, then `finish`."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id = msg_id
        self.model = model
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool:<call index>"
        self.used_tools = False

    def start(self, input_tokens: int) -> list[Event]:
        message = message_body(self.msg_id, self.model, [], None, None, usage(input_tokens, 0))
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def feed(self, delta: JsonObject) -> list[Event]:
        """Events for one chat delta ({"reasoning_content", "content", "tool_calls"}, any of them)."""
        events: list[Event] = []
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        content = delta.get("content")
        if isinstance(content, str) and content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            events += self._tool_call(call)
        return events

    def finish(self, reason: str, sequence: str | None, usage_fields: JsonObject) -> list[Event]:
        events = self._close()
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage_fields}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    # ------------------------------------------------------------------ blocks

    def _tool_call(self, call: JsonValue) -> list[Event]:
        """A chat tool-call delta: a header ({"index", "id", "function": {"name", ...}}) opens a tool_use
        block; argument text continues the open one."""
        if not isinstance(call, dict):
            return []
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        key = f"tool:{call.get('index', 0)}"
        events: list[Event] = []
        if "id" in call:
            self.used_tools = True
            events += self._open(key, {"type": "tool_use", "id": tool_use_id(str(call["id"])),
                                       "name": function.get("name"), "input": {}})
        elif key != self.open:
            return []  # the rest of a call whose block is closed: the parsers stream calls one after another
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _open(self, key: str, block: JsonObject) -> list[Event]:
        if key == self.open:
            return []
        events = self._close()
        self.index += 1
        self.open = key
        events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return events

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: JsonObject) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
