"""The Hermes tool-call parser on scripted outputs: whole and streamed results agree; bad output is content."""
from __future__ import annotations

import json

import pytest

from tokenloom.structured.tool_parsers import HermesToolParser, get_tool_parser, json_value_end

ONE = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
       '</tool_call>')
TWO = ('<tool_call>{"name": "a", "arguments": {"s": "x}y\\"z"}}</tool_call>\n'
       '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
UNCLOSED = '<tool_call>\n{"name": "f", "arguments": {"k": 1}}'
REORDERED = '<tool_call>{"arguments": {"name": "inner"}, "name": "outer"}</tool_call>'


def stream(text: str, step: int):
    parser = HermesToolParser()
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    content, deltas = content + c, deltas + d
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": None, "arguments": "", "ids": 0})
        if "id" in d:
            call["ids"] += 1
            call["name"] = d["function"]["name"]
        call["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", [ONE, TWO, UNCLOSED, REORDERED])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_matches_extract(text, step):
    content, calls = HermesToolParser().extract(text)
    s_content, s_calls = stream(text, step)
    assert s_content == (content or "")
    assert [(c["name"], c["arguments"], c["ids"]) for c in s_calls] == [(c.name, c.arguments, 1) for c in calls]
    for c in calls:
        json.loads(c.arguments)


def test_extract_values():
    content, calls = HermesToolParser().extract(ONE)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": [1, 2]})]
    assert calls[0].to_dict()["type"] == "function" and calls[0].id.startswith("call_")
    _, calls = HermesToolParser().extract(REORDERED)
    assert calls[0].name == "outer" and json.loads(calls[0].arguments) == {"name": "inner"}


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>[1]</tool_call>',
                                 '<tool_call>{"arguments": {}}</tool_call>', "text only"])
def test_malformed_is_content(bad):
    assert HermesToolParser().extract(bad) == (bad, [])


def test_incremental_arguments():
    parser = HermesToolParser()
    pieces = ['<tool_call>{"name": "f", ', '"arguments": {"a": ', '12', ', "b": "x"}', '}</tool_call>']
    args = []
    for p in pieces:
        _, deltas = parser.feed(p)
        args += [d["function"]["arguments"] for d in deltas if d["function"].get("arguments")]
    assert len(args) >= 3 and "".join(args) == '{"a": 12, "b": "x"}'


def test_json_value_end_and_registry():
    assert json_value_end('{"a": "}"} tail') == 10
    assert json_value_end('{"a": [1') is None
    assert get_tool_parser("hermes") is HermesToolParser
    tag = HermesToolParser().structural_tag([{"name": "f", "parameters": {"type": "object"}}], parallel=False)
    assert tag["format"]["stop_after_first"] is True and tag["format"]["at_least_one"] is True
