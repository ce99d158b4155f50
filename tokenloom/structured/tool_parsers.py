"""Tool-call parsers: model output text -> (content, tool calls), whole or streamed.

`HermesToolParser` reads the Hermes / Qwen format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Content is the text before the first call. `arguments` is the call's raw JSON text as the model
wrote it, so streamed argument deltas concatenate to exactly the non-streamed string. Any
malformed call makes the whole output plain content (never an error). The parser also builds the
xgrammar structural tag that forces its own format (tool_choice ``required`` or a named function).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokenloom.core.json_types import JsonObject

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self) -> JsonObject:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def json_value_end(text: str) -> int | None:
    """Index just past the JSON object/array/string at the start of `text`, or None if it is not complete."""
    if not text or text[0] not in "{[\"":
        return None
    depth, in_str, escape = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    raw = _raw_arguments(body)
    if raw is not None:
        try:
            if json.loads(raw) == args:
                return ToolCall(obj["name"], raw)
        except ValueError:
            pass
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _raw_arguments(body: str) -> str | None:
    m = _ARGS.search(body)
    if m is None:
        return None
    end = json_value_end(body[m.end():])
    return body[m.end():m.end() + end] if end else None


@dataclass
class _StreamedCall:
    """What has been streamed of one call: its id, its name once sent, the argument text sent so far."""
    id: str
    name: str | None = None
    sent: str = ""
    done: bool = False


class HermesToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0
        self._calls: list[_StreamedCall] = []

    # ------------------------------------------------------------------ whole output
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); a malformed call turns everything back into content."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for part in text[first:].split(self.start)[1:]:
            at = part.find(self.end)
            body = (part[:at] if at >= 0 else part).strip()
            call = _parse_call(body)
            if call is None:
                return text, []
            calls.append(call)
        content = text[:first].rstrip()
        return (content if content.strip() else None), calls

    # ------------------------------------------------------------------ streaming
    def feed(self, delta: str) -> tuple[str, list[JsonObject]]:
        """Streaming: (content delta, tool_call deltas in OpenAI's delta.tool_calls shape)."""
        self._text += delta
        return self._stream(final=False)

    def finish(self) -> tuple[str, list[JsonObject]]:
        """Streaming: the rest, once the output is complete."""
        return self._stream(final=True)

    def _stream(self, final: bool) -> tuple[str, list[JsonObject]]:
        text = self._text
        first = text.find(self.start)
        if first < 0:
            if final:
                return self._content(text), []
            held = text[:len(text) - _partial_suffix(text, self.start)]
            return self._content(held.rstrip()), []  # trailing space may precede a call
        deltas: list[JsonObject] = []
        for i, part in enumerate(text[first:].split(self.start)[1:]):
            closed = part.find(self.end)
            body = (part[:closed] if closed >= 0 else part).strip()
            if i >= len(self._calls):
                self._calls.append(_StreamedCall(id=f"call_{uuid.uuid4().hex[:24]}"))
            if not self._calls[i].done:
                deltas.extend(self._stream_call(i, self._calls[i], body, closed >= 0 or final))
        return self._content(text[:first].rstrip()), deltas

    def _content(self, content: str) -> str:
        delta = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        return delta

    def _stream_call(self, i: int, state: _StreamedCall, body: str, done: bool) -> list[JsonObject]:
        out: list[JsonObject] = []
        if done:
            state.done = True
            call = _parse_call(body)
            if call is None:
                return out  # malformed: nothing more for this call
            if state.name is None:
                state.name = call.name
                out.append(self._header(i, state))
            if call.arguments.startswith(state.sent) and len(call.arguments) > len(state.sent):
                out.append({"index": i, "function": {"arguments": call.arguments[len(state.sent):]}})
            return out
        name_m, args_m = _NAME.search(body), _ARGS.search(body)
        if name_m is None or (args_m is not None and args_m.start() < name_m.start()):
            return out  # arguments before the name: sent whole once the call is complete
        if state.name is None:
            try:
                state.name = json.loads(f'"{name_m.group(1)}"')
            except ValueError:
                return out
            out.append(self._header(i, state))
        if args_m is None:
            return out
        value = body[args_m.end():]
        if not value.startswith("{"):
            return out
        end = json_value_end(value)
        value = value[:end] if end else value
        if len(value) > len(state.sent):
            out.append({"index": i, "function": {"arguments": value[len(state.sent):]}})
            state.sent = value
        return out

    @staticmethod
    def _header(i: int, state: _StreamedCall) -> JsonObject:
        return {"index": i, "id": state.id, "type": "function", "function": {"name": state.name, "arguments": ""}}

    # ------------------------------------------------------------------ grammar
    def structural_tag(self, functions: list[JsonObject], parallel: bool = True,
                       any_whitespace: bool = False) -> JsonObject:
        """xgrammar structural tag: one or more calls (just one unless parallel) of these functions, in this
        parser's format, and nothing else.

        Calls follow each other with no separator, so after a complete call the model's choice is between
        ending (its end-of-turn token) and opening another call; a newline separator made a small model
        take the newline and then be forced into call after call until max_tokens. The JSON is compact
        (", " and ": " only) unless `any_whitespace`."""
        tags = []
        for fn in functions:
            schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                       "arguments": fn.get("parameters") or {"type": "object"}},
                      "required": ["name", "arguments"], "additionalProperties": False}
            content: JsonObject = {"type": "json_schema", "json_schema": schema}
            if not any_whitespace:  # compact JSON, as a grammar (a json_schema tag always allows whitespace)
                import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only
                ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False))
                content = {"type": "grammar", "grammar": ebnf}
            tags.append({"type": "tag", "begin": self.start + "\n", "content": content, "end": "\n" + self.end})
        return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "",
                                                     "at_least_one": True, "stop_after_first": not parallel}}


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser}


def register_tool_parser(name: str, cls: type[HermesToolParser]) -> None:
    TOOL_PARSERS[name] = cls


def get_tool_parser(name: str) -> type[HermesToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
