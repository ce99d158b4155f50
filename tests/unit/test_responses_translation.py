"""The Responses API's translations, without a server: input items -> chat messages, the request -> a chat
request, chat output -> output items, the stream's event sequences, and the bounded store. Events and
response objects are checked against the official `openai` package's types."""
from __future__ import annotations

import openai.types.responses as rt
import pytest
from pydantic import TypeAdapter

from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.responses.events import ResponseEvents
from tokenloom.entrypoints.openai.responses.input_items import items_to_messages
from tokenloom.entrypoints.openai.responses.output_items import output_items, response_object, status_of, usage
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest, parse_input_items
from tokenloom.entrypoints.openai.responses.store import ResponseStore
from tokenloom.entrypoints.openai.responses.to_chat import responses_param, to_chat_request

EVENT = TypeAdapter(rt.ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}


def messages_for(raw, instructions=None):
    return items_to_messages(parse_input_items(raw), instructions)


# ------------------------------------------------------------------ input items -> chat messages

def test_a_string_input_is_one_user_message_after_the_instructions():
    request = ResponsesRequest(input="hi", instructions="be brief")
    assert items_to_messages(request.input_items(), request.instructions) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_a_tool_round_trip_becomes_an_assistant_turn_and_a_tool_message():
    raw = [{"role": "developer", "content": "use tools"},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
           {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
           {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
           {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
           {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
           {"role": "user", "content": "thanks"}]
    assert messages_for(raw) == [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "call it",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "thanks"}]


def test_an_input_image_becomes_a_chat_image_url_part_in_place():
    content = [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]
    assert messages_for([{"role": "user", "content": content}]) == [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]


@pytest.mark.parametrize("raw, param", [
    ([{"type": "web_search_call", "id": "x"}], "input[0].type"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_file", "file_id": "u"}]}],
     "input[1].content[0].type"),
    ([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}], "input[0].content[0].image_url"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"role": "robot", "content": "a"}], "input[0].role"),
    ([{"role": "user", "content": 5}], "input[0].content"),
])
def test_a_bad_input_item_is_a_400_naming_it(raw, param):
    with pytest.raises(BadRequestError) as e:
        messages_for(raw)
    assert e.value.param == param


# ------------------------------------------------------------------ the request -> a chat request

def test_tools_tool_choice_and_text_format_map_onto_chat_fields():
    request = ResponsesRequest(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=7, temperature=0, parallel_tool_calls=False,
                               text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER,
                                                "strict": True}})
    chat = to_chat_request(request, [{"role": "user", "content": "x"}])
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                            "parameters": WEATHER}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                           "strict": True}}
    assert (chat.max_completion_tokens, chat.temperature, chat.parallel_tool_calls) == (7, 0, False)
    json_object = ResponsesRequest(input="x", text={"format": {"type": "json_object"}})
    assert to_chat_request(json_object, [{"role": "user", "content": "x"}]).response_format == {"type": "json_object"}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format.schema"),
])
def test_unsupported_or_incomplete_fields_are_400s_naming_them(body, param):
    with pytest.raises(BadRequestError) as e:
        to_chat_request(ResponsesRequest.model_validate(body), [{"role": "user", "content": "x"}])
    assert e.value.param == param


def test_chat_field_names_in_errors_become_responses_names():
    assert responses_param("messages[3].content") == "input"
    assert responses_param("max_completion_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tools[2].function.parameters") == "tools[2].parameters"
    assert responses_param("tool_choice.function.name") == "tool_choice.name"
    assert responses_param("temperature") == "temperature"


# ------------------------------------------------------------------ chat output -> output items

def test_a_chat_message_becomes_reasoning_text_and_call_items():
    message = {"role": "assistant", "reasoning_content": "think", "content": "Calling.",
               "tool_calls": [{"id": "call_9", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{}"}}]}
    items = output_items(message, "completed")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[2]["call_id"] == "call_9" and items[2]["id"].startswith("fc_")
    request = ResponsesRequest(input="x", tools=[TOOL], metadata={"k": "v"})
    body = response_object(request, "resp_1", "m", 1, "completed", items, usage(10, 5, 4, 2))
    response = rt.Response.model_validate(body)
    assert response.output_text == "Calling."
    assert response.usage.input_tokens_details.cached_tokens == 4
    assert response.usage.output_tokens_details.reasoning_tokens == 2 and response.usage.total_tokens == 15


def test_a_length_finish_is_incomplete_with_its_reason():
    status = status_of("length")
    items = output_items({"role": "assistant", "content": "trunc"}, status)
    response = rt.Response.model_validate(response_object(ResponsesRequest(input="x"), "resp_1", "m", 1, status,
                                                          items))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


# ------------------------------------------------------------------ stream events

def run_stream(deltas, status="completed"):
    events = ResponseEvents()
    start = response_object(ResponsesRequest(input="x"), "resp_1", "m", 1, "in_progress", [])
    out = events.start(start)
    for d in deltas:
        out += events.delta(d)
    out += events.finish(status)
    out += events.end(response_object(ResponsesRequest(input="x"), "resp_1", "m", 1, status, events.items))
    for e in out:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return [e["type"] for e in out], out, events.items


def test_text_stream_event_order_and_deltas_concatenate():
    types, out, items = run_stream([{"content": "Hel"}, {"content": "lo"}, {}])
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    done = next(e for e in out if e["type"] == "response.output_text.done")
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta") == done["text"] == "Hello"
    assert items[0]["content"][0]["text"] == "Hello" and items[0]["status"] == "completed"


def test_function_call_stream_events():
    deltas = [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    types, out, items = run_stream(deltas)
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert out[-3]["arguments"] == '{"city": "Paris"}'
    assert items == [out[-2]["item"]] and items[0]["call_id"] == "call_1" and items[0]["name"] == "get_weather"


def test_reasoning_then_text_are_two_items_in_order():
    types, out, items = run_stream([{"reasoning_content": "hmm"}, {"content": "ok"}], status="incomplete")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert "response.reasoning_text.delta" in types and types[-1] == "response.incomplete"
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert (items[0]["status"], items[1]["status"]) == ("completed", "incomplete")


def test_an_empty_output_streams_one_empty_message():
    types, _, items = run_stream([])
    assert "response.output_text.done" in types and items[0]["content"][0]["text"] == ""


# ------------------------------------------------------------------ the store

def entry(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": [text]}


def test_the_store_evicts_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    store.put(entry(1), [])
    store.put(entry(2), [])
    assert store.get("resp_1") is not None  # now the most recently used
    store.put(entry(3), [])
    assert store.get("resp_2") is None and store.get("resp_1") is not None and len(store) == 2
    store = ResponseStore(max_responses=100, max_bytes=1000)
    for i in range(10):
        store.put(entry(i, "x" * 200), [])
    assert store.total_bytes <= 1000 and store.get("resp_9") is not None and store.get("resp_0") is None
    assert not store.put(entry(99, "x" * 2000), []) and store.get("resp_99") is None
    assert store.delete("resp_9") and not store.delete("resp_9")
