"""POST /v1/responses with the official `openai` client on the embedded model (greedy, few tokens): text,
the typed event stream, function calls round-tripped with a function_call_output, text.format json_schema,
previous_response_id, GET / DELETE of stored responses, and OpenAI-shaped 400 / 404 errors."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]
MAX = 20


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "1024")
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def create(client, server, **kw):
    kw.setdefault("max_output_tokens", MAX)
    return client.responses.create(model=server.model, temperature=0, **kw)


def test_text_answer_and_its_stream_agree(client, server):
    r = create(client, server, input="What is the capital of France?", instructions="Answer in one sentence.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= MAX
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(create(client, server, input="What is the capital of France?",
                         instructions="Answer in one sentence.", stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == r.output_text


def test_max_output_tokens_makes_it_incomplete(client, server):
    r = create(client, server, input="Write a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_required_function_call_round_trips_with_its_output(client, server):
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = create(client, server, input=question, tools=TOOLS, tool_choice="required", max_output_tokens=60)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = question + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}]
    answer = create(client, server, input=follow, tools=TOOLS, tool_choice="none", max_output_tokens=5)
    assert answer.output[0].type == "message" and answer.output_text


def test_named_function_call_streams_its_arguments(client, server):
    events = list(create(client, server, input="Weather in Paris?", tools=TOOLS, stream=True, max_output_tokens=40,
                         tool_choice={"type": "function", "name": "get_weather"}))
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_json_schema_text_format_gives_valid_json(client, server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = create(client, server, input="Is Paris in France? Answer in JSON.",
               text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_and_stored_responses_get_and_delete(client, server):
    first = create(client, server, input="My name is Ada. Remember it.", max_output_tokens=5)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = create(client, server, input="What is my name?", previous_response_id=first.id, max_output_tokens=3)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    unstored = create(client, server, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": -5}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({}, "input"),
])
def test_invalid_requests_get_openai_shaped_400s(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": server.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
