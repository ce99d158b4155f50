"""Tool calls and JSON that finish: with the official `openai` client on the embedded
model, greedy, each of a named and a required tool call (max_tokens 40: the grammar's forced scaffold
costs its canonical tokens, jump-forward decoding), an auto tool call and a json_object answer
(max_tokens 60) is complete and parseable, with OpenAI's finish_reason; streamed and whole answers agree.

The embedded model's chat template does not render tools, so for `auto` the conversation itself tells
the model the functions and shows one call (what a user of such a model does); named and required
calls are constrained by the grammar and need no such help.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# For `auto`: the functions and the call format in the system prompt, and one example call.
AUTO_CHAT = [
    {"role": "system", "content": "You are a function-calling assistant. Functions: "
     + json.dumps([t["function"] for t in TOOLS])
     + '\nTo call a function reply with <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'},
    {"role": "user", "content": "What time is it in Tokyo?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>'},
    *CHAT]
MAX_TOKENS = 60
FORCED_MAX_TOKENS = 40  # named and required calls (what LangChain's bind_tools and LiteLLM send)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)


def create(client, server, **kw):
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=server.model, temperature=0, **kw)


def streamed(client, server, **kw):
    """(content, [(name, arguments)], finish_reason) assembled from the stream's deltas."""
    content, calls, finish = "", {}, None
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", MAX_TOKENS)
    for chunk in client.chat.completions.create(model=server.model, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, ["", ""])
                if tc.function and tc.function.name:
                    entry[0] = tc.function.name
                entry[1] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def assert_valid_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        if names is not None:
            assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_call_is_complete_with_finish_stop(client, server):
    """The output is constrained to get_weather's arguments; the server writes the call around them.
    OpenAI answers a forced function with finish_reason "stop"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = create(client, server, tools=TOOLS, tool_choice=named, max_tokens=FORCED_MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1
    assert r.usage.completion_tokens < FORCED_MAX_TOKENS
    content, calls, finish = streamed(client, server, tools=TOOLS, tool_choice=named, max_tokens=FORCED_MAX_TOKENS)
    assert (content, finish) == ("", "stop")
    assert calls == [("get_weather", choice.message.tool_calls[0].function.arguments)]


def test_required_tool_call_is_complete_with_finish_tool_calls(client, server):
    r = create(client, server, tools=TOOLS, tool_choice="required", max_tokens=FORCED_MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message.tool_calls)
    assert r.usage.completion_tokens <= FORCED_MAX_TOKENS
    content, calls, finish = streamed(client, server, tools=TOOLS, tool_choice="required",
                                      max_tokens=FORCED_MAX_TOKENS)
    assert finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_without_parallel_calls_makes_exactly_one(client, server):
    r = create(client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_tokens=FORCED_MAX_TOKENS, extra_body={"return_token_ids": True, "skip_special_tokens": False})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    text = client.post("/../detokenize", body={"tokens": choice.model_extra["token_ids"]}, cast_to=object)["prompt"]
    assert text.count("<tool_call>") == 1, text  # the grammar ended after one call


def test_a_required_calls_forced_scaffold_costs_its_canonical_tokens(client, server):
    """With one function the grammar forces the call up to its first argument's value: the output's first
    tokens are the tokenizer's own tokens of that text, and usage counts them as completion tokens."""
    scaffold = '<tool_call>\n{"name": "get_time", "arguments": {"city": "'
    r = create(client, server, tools=TOOLS[1:], tool_choice="required", max_tokens=FORCED_MAX_TOKENS,
               extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    canonical = httpx.post(server.url + "/tokenize", json={"prompt": scaffold, "add_special_tokens": False},
                           timeout=60).json()["tokens"]
    token_ids = choice.model_extra["token_ids"]
    assert token_ids[:len(canonical)] == canonical
    assert r.usage.completion_tokens == len(token_ids)


def test_auto_tool_call_is_complete(client, server):
    r = create(client, server, tools=TOOLS, tool_choice="auto", messages=AUTO_CHAT)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather"})
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    content, calls, finish = streamed(client, server, tools=TOOLS, tool_choice="auto", messages=AUTO_CHAT)
    assert (content, finish) == ("", "tool_calls")
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_tool_choice_none_gives_content_only(client, server):
    r = create(client, server, tools=TOOLS, tool_choice="none", messages=AUTO_CHAT)
    choice = r.choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_json_object_closes_within_the_budget(client, server):
    """Compact whitespace by default: the object closes (finish "stop") within 60 tokens."""
    messages = [{"role": "user", "content": "Describe Paris as a JSON object with a few fields."}]
    r = create(client, server, messages=messages, response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)
    assert "\n" not in choice.message.content
