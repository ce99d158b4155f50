"""Chat-style deltas -> the Responses API's typed stream events, numbered by ``sequence_number``.

`ResponseEvents` is fed what ChatOutputParser.delta gives (``reasoning_content``, ``content``,
``tool_calls`` deltas) and opens, fills and closes one output item at a time, in output order:

    output_item.added, content_part.added, (output_text | reasoning_text).delta*,
    (output_text | reasoning_text).done, content_part.done, output_item.done        (message, reasoning)
    output_item.added, function_call_arguments.delta*, function_call_arguments.done,
    output_item.done                                                                 (function call)

between ``response.created`` + ``response.in_progress`` and ``response.completed`` (or
``response.incomplete`` / ``response.failed``). Pure: no I/O, so each sequence is unit-tested.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.responses.output_items import (
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
)

# Per item kind: the content part type, and the event prefix of its text deltas.
_TEXT_KINDS = {"message": ("output_text", "response.output_text"),
               "reasoning": ("reasoning_text", "response.reasoning_text")}
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


@dataclass
class _OpenItem:
    output_index: int
    item: JsonObject
    text: str = ""


@dataclass
class ResponseEvents:
    items: list[JsonObject] = field(default_factory=list)
    sequence_number: int = 0
    _open: _OpenItem | None = None
    _calls: dict[int, _OpenItem] = field(default_factory=dict)  # chat tool-call index -> its item

    def event(self, kind: str, **fields: JsonValue) -> JsonObject:
        body: JsonObject = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return body

    # ---- the response around the items
    def start(self, response: JsonObject) -> list[JsonObject]:
        return [self.event("response.created", response=response), self.event("response.in_progress",
                                                                                 response=response)]

    def end(self, response: JsonObject) -> list[JsonObject]:
        return [self.event(_TERMINAL[str(response["status"])], response=response)]

    # ---- items
    def delta(self, chat_delta: JsonObject) -> list[JsonObject]:
        """Events for one chat delta (its reasoning, then its text, then its calls)."""
        events: list[JsonObject] = []
        reasoning = chat_delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            events += self._text("reasoning", reasoning)
        content = chat_delta.get("content")
        if isinstance(content, str) and content:
            events += self._text("message", content)
        calls = chat_delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            assert isinstance(call, dict)
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[JsonObject]:
        """Close the open item with the response's status; an output with no item gets one empty message,
        as OpenAI gives."""
        events = [] if self.items else self._open_text_item("message")
        return events + self._close(status)

    # ---- internals
    def _added(self, open_item: _OpenItem) -> list[JsonObject]:
        item = open_item.item
        events = [self.event("response.output_item.added", output_index=open_item.output_index, item=dict(item))]
        if item["type"] in _TEXT_KINDS:
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=open_item.output_index, content_index=0,
                                     part=self._part(str(item["type"]), "")))
        return events

    @staticmethod
    def _part(kind: str, text: str) -> JsonObject:
        return output_text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}

    def _open_text_item(self, kind: str) -> list[JsonObject]:
        item = message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress")
        item["content"] = []
        self._open = _OpenItem(len(self.items), item)
        self.items.append(item)
        return self._added(self._open)

    def _text(self, kind: str, text: str) -> list[JsonObject]:
        events: list[JsonObject] = []
        if self._open is None or self._open.item["type"] != kind:
            events += self._close("completed")
            events += self._open_text_item(kind)
        assert self._open is not None
        self._open.text += text
        extra: JsonObject = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"{_TEXT_KINDS[kind][1]}.delta", item_id=self._open.item["id"],
                                 output_index=self._open.output_index, content_index=0, delta=text, **extra))
        return events

    def _call(self, call: JsonObject) -> list[JsonObject]:
        events: list[JsonObject] = []
        index = call.get("index", 0)
        assert isinstance(index, int)
        fn = call.get("function")
        fn = fn if isinstance(fn, dict) else {}
        if index not in self._calls:
            events += self._close("completed")
            item = function_call_item(str(call.get("id")), str(fn.get("name") or ""), "", "in_progress")
            self._open = self._calls[index] = _OpenItem(len(self.items), item)
            self.items.append(item)
            events += self._added(self._open)
        open_item = self._calls[index]
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            open_item.text += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=open_item.item["id"],
                                     output_index=open_item.output_index, delta=arguments))
        return events

    def _close(self, status: str) -> list[JsonObject]:
        open_item, self._open = self._open, None
        if open_item is None:
            return []
        item, index, text = open_item.item, open_item.output_index, open_item.text
        item["status"] = status
        events: list[JsonObject] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=text))
        else:
            kind = str(item["type"])
            part = self._part(kind, text)
            item["content"] = [part]
            extra: JsonObject = {"logprobs": []} if kind == "message" else {}
            events.append(self.event(f"{_TEXT_KINDS[kind][1]}.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text, **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events
