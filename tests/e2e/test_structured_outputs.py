"""Structured outputs on the embedded model: offline (LLM) and through the real server.

The model is tiny, so the schemas are tight (enums, bounds, short strings) to end quickly;
the grammar, not the model, guarantees validity. Greedy everywhere, small max_tokens.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import ServerProcess

from tokenloom import SamplingParams
from tokenloom.structured import StructuredOutputError

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "admin": {"type": "boolean"}}, "required": ["name", "admin"]}},
        "required": ["user"]},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"]},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["age", "score"]},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "note": {"type": "string", "maxLength": 6},
        "flag": {"type": "boolean"}}, "required": ["id"]},
    "top_enum": {"enum": ["alpha", "beta", 3, None]},
}
PROMPT = "Give a short JSON example."
GREEDY = dict(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_blocks=256, max_model_len=1024)


def test_json_schemas_validate_and_free_rows_unaffected(llm):
    names = list(SCHEMAS)
    params = [SamplingParams(**GREEDY, structured_outputs={"json": SCHEMAS[n]}) for n in names]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([PROMPT] * len(names) + ["The capital of France is"], params + [free], use_tqdm=False)
    for name, out in zip(names, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (name, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMAS[name])
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outs[-1].outputs[0].token_ids


def test_regex_choice_grammar(llm):
    cases = [({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"choice": ["yes", "no", "maybe \"so\""]}, lambda t: t in ("yes", "no", 'maybe "so"')),
             ({"grammar": 'root ::= "A" [0-9] [0-9]? "B"'}, lambda t: re.fullmatch(r"A[0-9]{1,2}B", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so) for so, _ in cases]
    prompts = ["Answer:"] * (len(cases) - 1) + [PROMPT]  # "Answer:" makes the model write one endless key
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (so, ok), out in zip(cases, outs):
        o = out.outputs[0]
        # json_object too: compact whitespace (the default) lets the object close within 24 tokens
        assert o.finish_reason == "stop" and ok(o.text), (so, o.text)


@pytest.mark.parametrize("so,param,needle", [
    ({"json": {"type": "integr"}}, "structured_outputs.json", "#/type"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "uniqueItems"),
    ({"json": {"properties": {"a": {"not": {"type": "string"}}}}}, "structured_outputs.json", "#/properties/a"),
    ({"regex": "(ab"}, "structured_outputs", "parenthesis"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs", "line 1"),
    ({"choice": []}, "structured_outputs.choice", "list"),
    ({"json": {"type": "string"}, "regex": "a+"}, "structured_outputs", "exactly one"),
    ({"jsn": {}}, "structured_outputs", "unknown key"),
])
def test_invalid_constraints_rejected(llm, so, param, needle):
    with pytest.raises(StructuredOutputError) as info:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert info.value.param == param and needle in str(info.value)


def test_thinking_budget_forces_end_then_constraint(make_llm):
    llm = make_llm(num_blocks=128, max_model_len=512, reasoning_parser="think")
    prompt = "<|im_start|>user\nPick a color.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    params = SamplingParams(temperature=0.0, max_tokens=40, thinking_token_budget=6,
                            structured_outputs={"choice": ["red", "green"]})
    o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    reasoning, sep, answer = o.text.partition("</think>")
    assert sep and o.finish_reason == "stop", o.text
    assert answer in ("red", "green"), o.text


# ------------------------------------------------------------------ server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--reasoning-parser", "think")
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)


def _stream_chat(server, body):
    resp = server.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if tc.get("function", {}).get("name"):
                    call["name"] = tc["function"]["name"]
                call["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = c.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_server_json_schema_stream_equals_full(server, client):
    schema = SCHEMAS["bounded_numbers"]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    body = {"model": server.model, "messages": CHAT, "temperature": 0, "max_tokens": 40, "response_format": rf}
    full = client.chat.completions.create(**body)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    content, _, finish = _stream_chat(server, body)
    assert (content, finish) == (text, "stop")
    guided = server.post("/v1/completions", json={"model": server.model, "prompt": "Pick:", "temperature": 0,
                                                   "max_tokens": 8, "guided_choice": ["up", "down"]}).json()
    assert guided["choices"][0]["text"] in ("up", "down"), guided


@pytest.mark.parametrize("extra,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "response_format.json_schema.schema", "#/type"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= nope"}, "guided_grammar", "line 1"),
    ({"guided_json": {"type": "object", "properties": {"a": {"if": {}}}}}, "guided_json", "#/properties/a"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     "at most one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name", "missing"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
])
def test_server_rejects_invalid_constraints(server, extra, param, needle):
    resp = server.post("/v1/chat/completions", json={"model": server.model, "messages": CHAT, "max_tokens": 4,
                                                     **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_server_named_tool_call(server, client):
    body = {"model": server.model, "messages": CHAT, "temperature": 0, "max_tokens": 60, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    full = client.chat.completions.create(**body)
    choice = full.choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's finish reason for a forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    content, calls, finish = _stream_chat(server, body)
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_server_thinking_budget_needs_no_extra_and_reports_reasoning(server):
    prompt_kwargs = {"messages": [{"role": "user", "content": "Pick one."},
                                  {"role": "assistant", "content": "<think>\n"}],
                     "add_generation_prompt": False, "continue_final_message": True}
    body = {"model": server.model, "temperature": 0, "max_tokens": 30, "thinking_token_budget": 4,
            "guided_choice": ["left", "right"], **prompt_kwargs}
    resp = server.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    msg = resp.json()["choices"][0]["message"]
    assert msg["content"] in ("left", "right") and msg["reasoning_content"], msg
