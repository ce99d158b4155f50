"""The limits a JSON body meets before it is parsed (body_limits.check_body): each refusal names the
limit, the field where there is one, and its code; bodies within the limits pass untouched."""
from __future__ import annotations

import json

from tokenloom.entrypoints.openai.body_limits import (
    FIELD_LIMITS,
    MAX_JSON_VALUES,
    MAX_SPEC_RAW_BYTES,
    MAX_TEMPLATE_KWARGS_KEYS,
    OFF_LOOP_BYTES,
    check_body,
)
from tokenloom.entrypoints.openai.body_shape import MAX_MEASURED_FIELDS
from tokenloom.entrypoints.openai.limits import MAX_JSON_DEPTH

CHAT = [{"role": "user", "content": "hi"}]


def _body(**fields) -> bytes:
    return json.dumps({"messages": CHAT, **fields}).encode()


def test_an_ordinary_request_passes():
    assert check_body(_body(max_tokens=5, guided_json={"type": "object"}, chat_template_kwargs={"x": 1})) is None


def test_a_long_prompt_of_plain_text_passes():
    assert check_body(json.dumps({"prompt": "a, [b]: {c} \"d\" " * 200_000}).encode()) is None


def test_not_utf8():
    refusal = check_body(b'{"prompt": "\xff"}')
    assert refusal is not None and refusal.code == "invalid_json" and "UTF-8" in refusal.message


def test_nesting_deeper_than_the_limit():
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    refusal = check_body(('{"chat_template_kwargs": {"x": %s}}' % deep).encode())
    assert refusal is not None and refusal.code == "nesting_too_deep"


def test_too_many_json_values_in_the_body():
    refusal = check_body(json.dumps({"prompt": [1] * MAX_JSON_VALUES}).encode())
    assert refusal is not None and refusal.code == "request_too_large" and str(MAX_JSON_VALUES) in refusal.message


def test_two_context_length_token_prompts_fit_the_value_limit():
    assert check_body(json.dumps({"prompt": [[1] * 65_536, [2] * 65_000]}).encode()) is None


def test_too_many_top_level_fields():
    refusal = check_body(json.dumps({f"f{i}": 0 for i in range(MAX_MEASURED_FIELDS + 1)}).encode())
    assert refusal is not None and refusal.code == "request_too_large" and "top-level fields" in refusal.message


def test_a_structured_output_spec_over_its_raw_size_names_the_field():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SPEC_RAW_BYTES // 20)}}
    refusal = check_body(_body(guided_json=schema))
    assert refusal is not None and refusal.param == "guided_json" and refusal.code == "request_too_large"


def test_the_alias_json_schema_has_the_same_limit():
    refusal = check_body(_body(json_schema={"enum": ["x" * 100] * (MAX_SPEC_RAW_BYTES // 100)}))
    assert refusal is not None and refusal.param == "json_schema"


def test_chat_template_kwargs_with_too_many_keys():
    refusal = check_body(_body(chat_template_kwargs={f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS_KEYS + 1)}))
    assert refusal is not None and refusal.param == "chat_template_kwargs" and "keys" in refusal.message


def test_a_lone_surrogate_in_a_value_names_its_path():
    refusal = check_body(b'{"messages": [{"role": "user", "content": "a\\ud800"}]}')
    assert refusal is not None and refusal.param == "messages[0].content" and refusal.code == "invalid_value"


def test_a_lone_surrogate_in_an_unknown_top_level_key():
    refusal = check_body(b'{"prompt": "hi", "bo\\ud800gus": 1}')
    assert refusal is not None and refusal.param is None and "key" in refusal.message


def test_a_lone_surrogate_in_a_nested_key_names_the_object():
    refusal = check_body(b'{"messages": [{"role": "user", "content": "x", "\\udc00": 1}]}')
    assert refusal is not None and refusal.param == "messages[0]" and "key" in refusal.message


def test_a_surrogate_pair_is_text():
    assert check_body(b'{"prompt": "\\ud83d\\ude00"}') is None


def test_every_field_byte_limit_is_above_what_the_fast_path_skips():
    assert all(limit.max_bytes > OFF_LOOP_BYTES for limit in FIELD_LIMITS.values())


def test_a_small_body_near_the_key_limit_is_measured_not_waved_through():
    kwargs = {f"k{i}": 0 for i in range(MAX_TEMPLATE_KWARGS_KEYS + 1)}  # ~3 KB: under OFF_LOOP_BYTES
    refusal = check_body(_body(chat_template_kwargs=kwargs))
    assert refusal is not None and refusal.param == "chat_template_kwargs"
