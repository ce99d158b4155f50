"""The chat machinery's output in Anthropic's shapes: content blocks, stop reasons, usage, the stream's event
sequence (checked against the `anthropic` package's event types), and the error shape on the Messages paths
only (route errors, validation errors, and the answers of the middleware in front)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, TypeAdapter

from tokenloom.entrypoints.anthropic.blocks import content_blocks, message_body, stop_reason, tool_input, usage
from tokenloom.entrypoints.anthropic.errors import AnthropicErrorShapeMiddleware, AnthropicRoute, error_event
from tokenloom.entrypoints.anthropic.protocol import MessagesRequest
from tokenloom.entrypoints.anthropic.stream_events import MessageEventStream, sse_event
from tokenloom.entrypoints.anthropic.translate import to_chat_request
from tokenloom.entrypoints.openai.errors import NotFoundError, error_response, install_error_handlers
from tokenloom.entrypoints.openai.structured import ChatOutputParser

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
OUTPUT = '<think>Need the weather.</think>Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
         '{"city": "Paris"}}\n</tool_call>'


def parser(tool_choice=None) -> ChatOutputParser:
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "q"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        **({"tool_choice": tool_choice} if tool_choice else {})})
    config = SimpleNamespace(reasoning_parser="think", tool_call_parser="hermes")
    return ChatOutputParser(to_chat_request(req, reasoning_parser=True), config, "")


# ------------------------------------------------------------------ whole messages

def test_reasoning_text_and_tool_calls_become_blocks_in_order():
    message, _ = parser().message(OUTPUT, "stop")
    blocks = content_blocks(message)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0] == {"type": "thinking", "thinking": "Need the weather.", "signature": ""}
    assert blocks[1] == {"type": "text", "text": "Checking."}
    assert blocks[2]["name"] == "get_weather" and blocks[2]["input"] == {"city": "Paris"}
    assert blocks[2]["id"].startswith("toolu_")
    body = message_body("msg_1", "m", blocks, *stop_reason("stop", None, True, None), usage(30, 12, 16))
    parsed = Message.model_validate(body)  # the official client's model takes it
    assert parsed.stop_reason == "tool_use" and parsed.usage.input_tokens == 14
    assert parsed.usage.cache_read_input_tokens == 16


def test_a_named_tool_choice_output_is_one_tool_use_block():
    message, _ = parser({"type": "tool", "name": "get_weather"}).message('{"city": "Oslo"}', "stop")
    [block] = content_blocks(message)
    assert block["type"] == "tool_use" and block["input"] == {"city": "Oslo"}


def test_tool_input_is_always_an_object():
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input("") == {}
    assert tool_input("[1, 2]") == {"arguments": [1, 2]}
    assert tool_input("{not json") == {"arguments": "{not json"}


@pytest.mark.parametrize("finish, matched, tools, stops, expected", [
    ("stop", None, False, None, ("end_turn", None)),
    ("stop", 2, False, ["END"], ("end_turn", None)),  # the EOS token
    ("stop", "END", False, ["END"], ("stop_sequence", "END")),
    ("length", None, False, None, ("max_tokens", None)),
    ("length", None, True, None, ("max_tokens", None)),  # a call cut short is not a finished tool use
    ("stop", None, True, None, ("tool_use", None)),
])
def test_stop_reasons(finish, matched, tools, stops, expected):
    assert stop_reason(finish, matched, tools, stops) == expected


# ------------------------------------------------------------------ the stream

def stream_events(text: str, chunk: int, tool_choice=None) -> list[tuple[str, dict]]:
    p = parser(tool_choice)
    stream = MessageEventStream("msg_1", "m")
    events = stream.start(30)
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for n, piece in enumerate(pieces):
        events += stream.feed(p.delta(piece, n == len(pieces) - 1))
    reason, sequence = stop_reason("stop", None, stream.used_tools, None)
    return events + stream.finish(reason, sequence, {"output_tokens": 20})


def accumulate(events: list[tuple[str, dict]]) -> dict:
    """What a client assembles: the message_start message with the blocks filled in by the deltas."""
    message = None
    partial: dict[int, str] = {}
    for _, data in events:
        kind = data["type"]
        if kind == "message_start":
            message = data["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
        elif kind == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif kind == "message_delta":
            message.update(data["delta"])
    return message


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_stream_event_sequence_and_shapes(chunk):
    events = stream_events(OUTPUT, chunk)
    for name, data in events:
        assert name == data["type"]
        if name != "ping":  # the keep-alive is outside the typed union
            EVENT.validate_python(data)  # every event is one of Anthropic's
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    # one block open at a time: each block's deltas sit between its start and its stop
    open_index = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            open_index = None
    streamed = accumulate(events)
    whole = content_blocks(parser().message(OUTPUT, "stop")[0])
    assert len(streamed["content"]) == len(whole)
    for a, b in zip(streamed["content"], whole):
        a.pop("id", None), b.pop("id", None)
    assert streamed["content"] == whole
    assert streamed["stop_reason"] == "tool_use"


def test_stream_of_a_named_tool_call_is_one_tool_use_block():
    events = stream_events('{"city": "Oslo"}', 4, {"type": "tool", "name": "get_weather"})
    message = accumulate(events)
    assert [b["type"] for b in message["content"]] == ["tool_use"]
    assert message["content"][0]["input"] == {"city": "Oslo"} and message["stop_reason"] == "tool_use"


def test_plain_text_stream_and_sse_framing():
    stream = MessageEventStream("msg_1", "m")
    events = stream.start(5) + stream.feed({"content": "Hi"}) + stream.feed({"content": "!"}) \
        + stream.finish("end_turn", None, {"output_tokens": 2})
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert sse_event(events[-1]) == 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert stream.feed({}) == []


def test_error_event():
    text = error_event(NotFoundError("no such model"))
    assert text.startswith("event: error\ndata: ")
    assert json.loads(text.split("data: ", 1)[1]) == {"type": "error", "error": {"type": "not_found_error",
                                                                                 "message": "no such model"}}


# ------------------------------------------------------------------ the error shape, on these paths only

class Body(BaseModel):
    max_tokens: int


def app_with_routes() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=AnthropicRoute)

    @router.post("/v1/messages")
    async def messages(body: Body):
        if body.max_tokens == 404:
            raise NotFoundError("missing")
        if body.max_tokens == 500:
            raise RuntimeError("boom")
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(body: Body):
        return {"ok": True}

    async def deny_key(scope, receive, send):  # what the API-key middleware answers, in OpenAI's shape
        if dict(scope["headers"]).get(b"x-api-key") == b"bad":
            return await error_response(401, "Incorrect API key provided.")(scope, receive, send)
        return await inner(scope, receive, send)

    app.include_router(router)
    inner = app.build_middleware_stack()
    return AnthropicErrorShapeMiddleware(deny_key)


def post(app, path, body, headers=None) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers or {})
    return asyncio.run(main())


def test_errors_on_messages_paths_take_anthropic_shape_and_others_keep_theirs():
    app = app_with_routes()
    cases = [({}, None, 400, "invalid_request_error"), ({"max_tokens": 404}, None, 404, "not_found_error"),
             ({"max_tokens": 500}, None, 500, "api_error"), ({"max_tokens": 1}, {"x-api-key": "bad"}, 401,
                                                                "authentication_error")]
    for body, headers, status, kind in cases:
        r = post(app, "/v1/messages", body, headers)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        assert int(r.headers["content-length"]) == len(r.content)
    assert post(app, "/v1/messages", {"max_tokens": 1}).json() == {"ok": True}
    r = post(app, "/v1/chat/completions", {})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "max_tokens"
