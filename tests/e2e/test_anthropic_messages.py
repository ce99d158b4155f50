"""POST /v1/messages and /v1/messages/count_tokens on the real server and the embedded model, driven by the
official `anthropic` client (greedy, small max_tokens): a message, its stream (text_stream, event order),
a forced tool use and the tool_result turn after it, stop_sequences, token counts, and Anthropic-shaped
errors for invalid requests, a wrong key and an unknown model. One server, with --api-key (the client
sends it as `x-api-key`)."""
from __future__ import annotations

import anthropic
import httpx
import pytest
from server_harness import ServerProcess

API_KEY = "test-key-anthropic"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"extra_body": {"temperature": 0}}  # this client version has no temperature argument


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", API_KEY, "--max-model-len", "1024")
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_message(client, server):
    m = client.messages.create(model=server.model, max_tokens=12, messages=QUESTION, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == server.model
    assert m.id.startswith("msg_") and "Paris" in text_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 12
    counted = client.messages.count_tokens(model=server.model, messages=QUESTION).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted


def test_stream_matches_the_message_and_keeps_anthropics_event_order(client, server):
    whole = client.messages.create(model=server.model, max_tokens=10, messages=QUESTION, **GREEDY)
    with client.messages.stream(model=server.model, max_tokens=10, messages=QUESTION, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    r = httpx.post(server.url + "/v1/messages", timeout=60,
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
                   json={"model": server.model, "max_tokens": 4, "stream": True, "messages": QUESTION})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_round_trip(client, server):
    kw = {"model": server.model, "max_tokens": 24, "tools": [WEATHER_TOOL],
          "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    m = client.messages.create(messages=ask, **kw)
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input.get("city"), str)
    assert m.stop_reason == "tool_use"
    with client.messages.stream(messages=ask, **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]
    assert streamed.stop_reason == "tool_use"
    answer = client.messages.create(
        model=server.model, max_tokens=8, tools=[WEATHER_TOOL], **GREEDY,
        messages=[*ask, {"role": "assistant", "content": m.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": [{"type": "text", "text": "Sunny, 24 C"}]}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and text_of(answer)


def test_stop_sequences(client, server):
    m = client.messages.create(model=server.model, max_tokens=12, messages=QUESTION, stop_sequences=["Paris"],
                               **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in text_of(m)


def test_count_tokens_counts_the_rendered_prompt(client, server):
    counted = client.messages.count_tokens(model=server.model, messages=QUESTION,
                                           system=[{"type": "text", "text": "Answer in one word."}]).input_tokens
    chat = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    tokenized = httpx.post(server.url + "/tokenize", json={"model": server.model, "messages": chat}, timeout=30,
                           headers={"x-api-key": API_KEY}).json()
    assert counted == tokenized["count"] > 0


@pytest.mark.parametrize("body, fragment", [
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
])
def test_invalid_requests_are_anthropic_shaped_400s(client, server, body, fragment):
    with pytest.raises(anthropic.BadRequestError) as e:  # posted as is: the client itself checks max_tokens
        client.post("/v1/messages", cast_to=httpx.Response, body={"model": server.model, **body})
    assert e.value.status_code == 400
    error = e.value.body["error"]
    assert e.value.body["type"] == "error" and error["type"] == "invalid_request_error"
    assert fragment in error["message"]


def test_other_failures_are_anthropic_shaped(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=server.model, max_tokens=4, messages=QUESTION)
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(server.url + "/v1/messages/count_tokens", timeout=30,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    json={"model": server.model, "messages": QUESTION})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    r = httpx.post(server.url + "/v1/messages", timeout=30, headers={"x-api-key": API_KEY},
                   json={"model": "claude-unknown", "max_tokens": 4, "messages": QUESTION})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    # the OpenAI paths keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, headers={"x-api-key": API_KEY}, json={})
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["param"] == "messages"
