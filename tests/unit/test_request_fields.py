"""Which request fields the OpenAI-shaped APIs take (protocol.py, docs/apis.md): OpenAI's, vLLM's extras
and other engines' aliases; anything else is a 400 naming the field, and types are OpenAI's strict ones."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenloom.entrypoints.anthropic.protocol import MessagesRequest
from tokenloom.entrypoints.openai.errors import validation_error_to_api_error
from tokenloom.entrypoints.openai.protocol import (
    NOT_IMPLEMENTED,
    NOT_SERVED,
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest
from tokenloom.entrypoints.openai.serving_embedding import EmbeddingRequest

CHAT = [{"role": "user", "content": "hi"}]


def _error(model, body: dict):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error_to_api_error(list(info.value.errors()))


@pytest.mark.parametrize("model,body", [
    (ChatCompletionRequest, {"messages": CHAT}),
    (CompletionRequest, {"prompt": "hi"}),
    (EmbeddingRequest, {"input": "hi"}),
    (ResponsesRequest, {"input": "hi"}),
    (MessagesRequest, {"model": "m", "max_tokens": 5, "messages": CHAT}),
])
def test_an_unknown_field_is_a_400_naming_it(model, body):
    err = _error(model, {**body, "bogus_field": 1})
    assert err.param == "bogus_field" and err.code == "unknown_parameter" and "bogus_field" in err.message


def test_openai_chat_fields_that_clients_send_are_accepted():
    ChatCompletionRequest.model_validate({
        "messages": CHAT, "model": "m", "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "parallel_tool_calls": True, "stream": True, "stream_options": {"include_usage": True,
                                                                        "include_obfuscation": False},
        "prediction": {"type": "content", "content": "x"}, "modalities": ["text"], "reasoning_effort": "low",
        "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "s", "seed": 1, "logprobs": True,
        "top_logprobs": 2, "max_completion_tokens": 5, "response_format": {"type": "text"}, "n": 1})


def test_vllm_extras_are_accepted():
    CompletionRequest.model_validate({
        "prompt": "hi", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
        "stop_token_ids": [1], "skip_special_tokens": False, "bad_words": ["x"], "allowed_token_ids": [1, 2],
        "priority": 1, "request_id": "r", "cache_salt": "s", "guided_choice": ["a"],
        "guided_decoding_backend": "xgrammar", "add_special_tokens": True, "use_beam_search": False,
        "length_penalty": 1.0, "logits_processors": []})


@pytest.mark.parametrize("name", sorted(n for n in NOT_IMPLEMENTED if n != "prompt_embeds"))  # completions only
def test_a_vllm_field_tokenloom_does_not_implement_is_a_400_unless_it_asks_for_nothing(name):
    value = {"x": 1} if NOT_IMPLEMENTED[name] is None else "other"
    err = _error(ChatCompletionRequest, {"messages": CHAT, name: value})
    assert err.param == name and "not supported" in err.message


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_an_openai_field_for_what_is_not_served_is_a_400_even_when_empty(name):
    err = _error(ChatCompletionRequest, {"messages": CHAT, name: {}})
    assert err.param == name and "does not serve" in err.message


def test_a_string_for_an_int_is_a_400_as_at_openai():
    err = _error(CompletionRequest, {"prompt": "hi", "max_tokens": "5"})
    assert err.param == "max_tokens"
    assert _error(ChatCompletionRequest, {"messages": CHAT, "stream": "true"}).param == "stream"


def test_an_int_is_a_float():
    assert ChatCompletionRequest.model_validate({"messages": CHAT, "temperature": 1}).temperature == 1.0


def test_seed_outside_int64_is_a_range_error_from_the_schema():
    ok = CompletionRequest.model_validate({"prompt": "hi", "seed": SEED_MAX})
    assert ok.seed == SEED_MAX
    err = _error(CompletionRequest, {"prompt": "hi", "seed": 2 ** 64 - 1})
    assert err.param == "seed" and "less than or equal to" in err.message
    assert "less than or equal to" in _error(CompletionRequest, {"prompt": "hi", "priority": 2 ** 63}).message


def test_llama_cpp_spellings_are_fields():
    request = CompletionRequest.model_validate({"prompt": "hi", "grammar": 'root ::= "a"', "json_schema": {}})
    assert request.grammar == 'root ::= "a"' and request.json_schema == {}


def test_chat_takes_text_output_only():
    assert _error(ChatCompletionRequest, {"messages": CHAT, "modalities": ["text", "audio"]}).param == "modalities[1]"


def test_message_objects_keep_their_extra_keys_for_the_template():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": "x",
                                                                  "reasoning_content": "r"}]})
    assert request.messages[0].model_dump()["reasoning_content"] == "r"
