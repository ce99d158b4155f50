"""Anthropic Messages requests -> chat completion requests: blocks to chat messages (tool_use, tool_result,
thinking), tools and tool_choice, sampling fields, thinking, prefill, and the request models' checks."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenloom.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from tokenloom.entrypoints.anthropic.translate import chat_messages, to_chat_request
from tokenloom.entrypoints.openai.errors import BadRequestError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(messages, **kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, "messages": messages, **kw})


def test_string_and_text_block_content_are_the_same():
    a = request([{"role": "user", "content": "hi"}])
    b = request([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat_messages(a) == chat_messages(b) == [{"role": "user", "content": "hi"}]


def test_system_string_or_blocks_is_one_system_message():
    blocks = request([{"role": "user", "content": "q"}],
                     system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}])
    assert chat_messages(blocks)[0] == {"role": "system", "content": "Be brief.\n\nBe kind."}
    plain = request([{"role": "user", "content": "q"}], system="Be brief.")
    assert chat_messages(plain) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]


def test_tool_use_and_tool_result_round_trip_as_chat_tool_messages():
    req = request([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]},
    ])
    messages = chat_messages(req)
    assert messages[1] == {"role": "assistant", "content": "Let me check.",
                           "reasoning_content": "I should call the tool.",
                           "tool_calls": [{"id": "toolu_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
                            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
                            {"role": "user", "content": "And tomorrow?"}]
    chat = to_chat_request(req)  # the chat request model accepts the translation
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool", "user"]


def test_redacted_thinking_is_dropped():
    req = request([{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"},
                                                     {"type": "text", "text": "a"}]},
                   {"role": "user", "content": "q2"}])
    assert chat_messages(req)[1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("role, block", [
    ("user", {"type": "tool_use", "id": "t", "name": "f", "input": {}}),
    ("user", {"type": "thinking", "thinking": "x"}),
    ("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
])
def test_a_block_in_the_wrong_turn_is_a_400_naming_it(role, block):
    req = request([{"role": "user", "content": "q"}, {"role": role, "content": [block]}])
    with pytest.raises(BadRequestError) as e:
        chat_messages(req)
    assert e.value.param == "messages[1].content[0]"


def test_tools_and_tool_choice_map_to_chat_fields():
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
             {"name": "noop", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "q"}]
    chat = to_chat_request(request(msgs, tools=tools))
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                            "description": "Weather"}},
                          {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    assert chat.tool_choice is None
    cases = [({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None), ({"type": "none"}, "none", None),
             ({"type": "tool", "name": "noop", "disable_parallel_tool_use": True},
              {"type": "function", "function": {"name": "noop"}}, False)]
    for choice, expected, parallel in cases:
        chat = to_chat_request(request(msgs, tools=tools, tool_choice=choice))
        assert chat.tool_choice == expected
        assert chat.parallel_tool_calls is parallel
    # auto / none without tools is no choice at all (the chat API would refuse 'auto' without tools)
    assert to_chat_request(request(msgs, tool_choice={"type": "auto"})).tool_choice is None


def test_sampling_fields_and_metadata():
    chat = to_chat_request(request([{"role": "user", "content": "q"}], stop_sequences=["\n\n", "END"],
                                   temperature=0.2, top_p=0.9, top_k=40, stream=True,
                                   metadata={"user_id": "u1"}))
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.stream, chat.user) == \
        (16, ["\n\n", "END"], 0.2, 0.9, 40, True, "u1")
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_a_final_assistant_turn_with_text_is_a_prefill():
    chat = to_chat_request(request([{"role": "user", "content": "Pick A or B"},
                                    {"role": "assistant", "content": "The answer is ("}]))
    assert chat.continue_final_message and not chat.add_generation_prompt


def test_thinking_needs_a_reasoning_parser():
    msgs = [{"role": "user", "content": "q"}]
    enabled = request(msgs, thinking={"type": "enabled", "budget_tokens": 1024})
    chat = to_chat_request(enabled, reasoning_parser=True)
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.thinking_token_budget == 1024
    off = to_chat_request(request(msgs, thinking={"type": "disabled"}), reasoning_parser=True)
    assert off.chat_template_kwargs == {"enable_thinking": False} and off.thinking_token_budget is None
    ignored = to_chat_request(enabled, reasoning_parser=False)
    assert ignored.chat_template_kwargs is None and ignored.thinking_token_budget is None


def test_output_format_is_a_json_schema_response_format():
    chat = to_chat_request(request([{"role": "user", "content": "q"}],
                                   output_config={"format": {"type": "json_schema", "schema": WEATHER}}))
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": WEATHER}}


def test_count_request_needs_no_max_tokens():
    req = MessagesCountRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "q"}]})
    chat = to_chat_request(req)
    assert chat.max_tokens is None and chat.messages[0].content == "q"


def test_long_text_is_not_a_long_list():
    long_result = {"type": "tool_result", "tool_use_id": "t", "content": "x" * 5000}
    req = request([{"role": "user", "content": "y" * 5000}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": [long_result]}], system="z" * 5000)
    assert [len(m["content"]) for m in chat_messages(req)] == [5000, 5000, 1, 5000]
    with pytest.raises(ValidationError):
        request([{"role": "user", "content": [{**long_result, "content": [{"type": "text", "text": "a"}] * 257}]}])


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "q"}]}, ("max_tokens",)),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "q"}]}, ("messages", 0, "role")),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     ("messages", 0, "content", 0)),
    ({"max_tokens": 8, "messages": []}, ("messages",)),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "q"}]}, ("max_tokens",)),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "q"}], "tool_choice": {"type": "tool"}},
     ("tool_choice",)),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "q"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ("tools", 0, "type")),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "q"}], "stop_sequences": [""]},
     ("stop_sequences",)),
])
def test_invalid_requests_fail_validation_at_the_field(body, where):
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({"model": "m", **body})
    assert e.value.errors()[0]["loc"][:len(where)] == where
