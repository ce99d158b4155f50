"""The native APIs' translations (Ollama's /api/*, llama-server's /completion), without a server: options
onto sampling fields, formats onto structured outputs, and the NDJSON / SSE shapes built from OpenAI
stream events."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from starlette.routing import Route

from tokenloom.entrypoints.native.llamacpp_protocol import LlamaCppCompletionRequest
from tokenloom.entrypoints.native.llamacpp_translate import completion_answer, completion_request, completion_stream
from tokenloom.entrypoints.native.ollama_models import family, parameter_size, quantization_level, tagged
from tokenloom.entrypoints.native.ollama_protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
)
from tokenloom.entrypoints.native.ollama_responses import chat_answer, chat_stream, embed_answer, generate_stream
from tokenloom.entrypoints.native.ollama_translate import (
    chat_request,
    embed_request,
    generate_request,
    sampling_fields,
    served_name,
)
from tokenloom.entrypoints.native.relay import GenerationTimer, sse_events
from tokenloom.entrypoints.openai.errors import APIError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.route_suggest import nearest_path, not_found_message

MODEL = "tiny"


def run(coro):
    return asyncio.run(coro)


async def events_of(*events: dict):
    for e in events:
        yield e


async def lines_of(gen) -> list[dict]:
    return [json.loads(line[len("data: "):] if line.startswith("data: ") else line) async for line in gen]


def chat_events(*texts: str, finish: str = "stop", stop_reason=None, tool_calls: list | None = None) -> list[dict]:
    out = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    out += [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in texts]
    last = {"index": 0, "delta": {"tool_calls": tool_calls} if tool_calls else {}, "finish_reason": finish,
            "stop_reason": stop_reason}
    out.append({"choices": [last]})
    out.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(texts)}})
    return out


# ------------------------------------------------------------------ Ollama: requests

def test_options_map_onto_the_engine_fields_and_unknown_ones_are_ignored(caplog):
    options = OllamaOptions.model_validate({"temperature": 0.2, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                                            "num_predict": 12, "stop": ["\n"], "seed": 3, "repeat_penalty": 1.1,
                                            "presence_penalty": 0.5, "frequency_penalty": 0.25, "mirostat": 2,
                                            "num_ctx": 4096})
    with caplog.at_level(logging.DEBUG, logger="tokenloom.server"):
        fields = sampling_fields(options)
    assert fields == {"temperature": 0.2, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "max_tokens": 12, "stop": ["\n"],
                      "seed": 3, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert "mirostat, num_ctx" in caplog.text


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_without_a_limit_sets_no_max_tokens(num_predict):
    assert "max_tokens" not in sampling_fields(OllamaOptions(num_predict=num_predict))


def test_a_bad_option_value_is_a_400_naming_it():
    with pytest.raises(Exception) as e:
        OllamaChatRequest.model_validate({"model": MODEL, "messages": [], "options": {"temperature": -1}})
    assert "options" in str(e.value) and "temperature" in str(e.value)


def test_chat_request_translates_messages_tools_format_and_streams_from_the_handler():
    request = OllamaChatRequest.model_validate({
        "model": MODEL + ":latest", "stream": False, "format": {"type": "object"}, "think": True,
        "options": {"num_predict": 4},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": {"x": 1}}}]},
                     {"role": "tool", "content": "42", "tool_name": "f"}]})
    out = chat_request(request, served_name(request.model, [MODEL]))
    assert isinstance(out, ChatCompletionRequest)
    assert out.model == MODEL and out.stream and out.include_usage and out.max_tokens == 4
    assert out.response_format == {"type": "json_schema", "json_schema": {"name": "format",
                                                                          "schema": {"type": "object"}}}
    assert out.chat_template_kwargs == {"enable_thinking": True}
    assert out.messages[1].model_dump()["tool_calls"] == [{"type": "function",
                                                           "function": {"name": "f", "arguments": {"x": 1}}}]
    assert out.messages[2].name == "f" and out.tools[0]["function"]["name"] == "f"
    json_mode = chat_request(OllamaChatRequest(model=MODEL, format="json", messages=request.messages[:1]), MODEL)
    assert json_mode.response_format == {"type": "json_object"}


def test_images_an_unknown_model_and_unsupported_generate_fields_are_refused():
    with pytest.raises(APIError) as e:
        chat_request(OllamaChatRequest.model_validate({"model": MODEL, "messages": [
            {"role": "user", "content": "x", "images": ["aGk="]}]}), MODEL)
    assert e.value.status_code == 400 and e.value.param == "messages[0].images"
    with pytest.raises(APIError) as e:
        served_name("other", [MODEL])
    assert e.value.status_code == 404 and e.value.message == "model 'other' not found"
    for field, value in (("suffix", "end"), ("context", [1, 2]), ("template", "{{ .Prompt }}"), ("images", ["x"])):
        with pytest.raises(APIError) as e:
            generate_request(OllamaGenerateRequest.model_validate({"model": MODEL, "prompt": "p", field: value}),
                             MODEL, True)
        assert e.value.status_code == 400 and e.value.param == field


def test_generate_uses_the_template_unless_raw():
    templated = generate_request(OllamaGenerateRequest(model=MODEL, prompt="p", system="s"), MODEL, True)
    assert isinstance(templated, ChatCompletionRequest)
    assert [(m.role, m.content) for m in templated.messages] == [("system", "s"), ("user", "p")]
    raw = generate_request(OllamaGenerateRequest(model=MODEL, prompt="p", raw=True), MODEL, True)
    assert isinstance(raw, CompletionRequest) and raw.prompt == "p"
    base = generate_request(OllamaGenerateRequest(model=MODEL, prompt="p", system="s"), MODEL, False)
    assert isinstance(base, CompletionRequest) and base.prompt == "s\n\np"


def test_embed_request_and_answer():
    request = embed_request(OllamaEmbedRequest(model=MODEL, input=["a", "b"], options={"num_ctx": 8}), MODEL)
    assert request.inputs() == ["a", "b"] and request.encoding_format == "float"
    body = {"data": [{"index": 1, "embedding": [0.5]}, {"index": 0, "embedding": [0.25]}],
            "usage": {"prompt_tokens": 4}}
    answer = embed_answer(body, MODEL, GenerationTimer())
    assert answer["embeddings"] == [[0.25], [0.5]] and answer["prompt_eval_count"] == 4
    assert answer["total_duration"] >= 0 and answer["load_duration"] == 0


# ------------------------------------------------------------------ Ollama: answers

def test_chat_stream_is_ndjson_ending_with_counts_and_durations_in_nanoseconds():
    lines = run(lines_of(chat_stream(events_of(*chat_events("Hel", "lo", finish="length")), MODEL,
                                     GenerationTimer())))
    assert [line["message"]["content"] for line in lines] == ["Hel", "lo", ""]
    assert all(line["model"] == MODEL and line["created_at"].endswith("Z") for line in lines)
    assert [line["done"] for line in lines] == [False, False, True]
    final = lines[-1]
    assert final["done_reason"] == "length" and final["prompt_eval_count"] == 7 and final["eval_count"] == 2
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int) and final[key] >= 0
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"] - 1


def test_tool_calls_are_pieced_together_with_object_arguments():
    calls = [{"index": 0, "id": "c", "type": "function", "function": {"name": "get", "arguments": '{"city": '}},
             {"index": 0, "function": {"arguments": '"Paris"}'}}]
    events = chat_events(tool_calls=calls, finish="tool_calls")
    lines = run(lines_of(chat_stream(events_of(*events), MODEL, GenerationTimer())))
    assert lines[-2]["message"]["tool_calls"] == [{"function": {"name": "get", "arguments": {"city": "Paris"}}}]
    assert lines[-1]["done_reason"] == "stop"
    whole = run(chat_answer(events_of(*events), MODEL, GenerationTimer()))
    assert whole["message"]["tool_calls"] == lines[-2]["message"]["tool_calls"] and whole["done"] is True


def test_a_stream_error_is_a_last_error_line_and_a_whole_answer_raises():
    events = chat_events("a")[:2] + [{"error": {"message": "engine died", "type": "server_error"}}]
    lines = run(lines_of(chat_stream(events_of(*events), MODEL, GenerationTimer())))
    assert lines[-1] == {"error": "engine died"}
    with pytest.raises(APIError):
        run(chat_answer(events_of(*events), MODEL, GenerationTimer()))


def test_generate_stream_shape():
    lines = run(lines_of(generate_stream(events_of(*chat_events("x")), MODEL, GenerationTimer())))
    assert lines[0] == {"model": MODEL, "created_at": lines[0]["created_at"], "response": "x", "done": False}
    assert lines[-1]["response"] == "" and lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_model_details_from_names_and_files():
    assert tagged("m") == "m:latest" and tagged("m:7b") == "m:7b"
    assert family("LlamaForCausalLM") == "llama" and family("Gemma3ForCausalLM") == "gemma3"
    assert parameter_size("smollm2-135m-instruct") == "135M" and parameter_size("qwen2.5-1.5b") == "1.5B"
    assert parameter_size("model") == "unknown"
    assert quantization_level("/m/SmolLM2.Q4_K_M.gguf", "float32") == "Q4_K_M"
    assert quantization_level("/m/folder", "bfloat16") == "BF16"


# ------------------------------------------------------------------ llama.cpp

def completion_events(*texts: str, finish: str = "stop", stop_reason=None) -> list[dict]:
    out = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    out.append({"choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": stop_reason}]})
    out.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}})
    return out


def test_completion_request_maps_llama_server_fields():
    request = LlamaCppCompletionRequest.model_validate({
        "prompt": [1, 2, 3], "n_predict": 5, "temperature": 0, "top_k": 1, "repeat_penalty": 1.2, "seed": -1,
        "grammar": 'root ::= "a"', "stop": [], "cache_prompt": True})
    out = completion_request(request, MODEL)
    assert out.prompt == [1, 2, 3] and out.max_tokens == 5 and out.temperature == 0 and out.top_k == 1
    assert out.repetition_penalty == 1.2 and out.seed is None and out.guided_grammar == 'root ::= "a"'
    assert out.stop is None and out.stream and out.include_usage
    schema = {"type": "object"}
    assert completion_request(LlamaCppCompletionRequest(prompt="p", json_schema=schema, n_predict=-1),
                              MODEL).response_format["json_schema"]["schema"] == schema
    assert completion_request(LlamaCppCompletionRequest(prompt="p"), MODEL).max_tokens is None


@pytest.mark.parametrize("finish, stop_reason, kind, word", [("length", None, "limit", ""), ("stop", None, "eos", ""),
                                                            ("stop", "\n", "word", "\n"), ("abort", None, "none", "")])
def test_completion_answer_stop_types(finish, stop_reason, kind, word):
    body = run(completion_answer(events_of(*completion_events("a", "b", finish=finish, stop_reason=stop_reason)),
                                 MODEL, "p", GenerationTimer()))
    assert body["content"] == "ab" and body["stop"] is True and body["stop_type"] == kind
    assert body["stopping_word"] == word and body["tokens_predicted"] == 2 and body["tokens_evaluated"] == 3
    assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}


def test_completion_stream_is_sse_content_then_the_final_object():
    lines = run(lines_of(completion_stream(events_of(*completion_events("a", "b")), MODEL, "p", GenerationTimer())))
    assert [(line["content"], line["stop"]) for line in lines] == [("a", False), ("b", False), ("", True)]
    assert lines[-1]["stop_type"] == "eos" and lines[-1]["timings"]["predicted_n"] == 2


def test_sse_events_reads_split_chunks_up_to_done():
    async def body():
        yield 'data: {"a": 1}\n\ndata: {"b"'
        yield ': 2}\n\n'
        yield "data: [DONE]\n\n"
        yield 'data: {"never": 0}\n\n'

    async def read():
        return [e async for e in sse_events(body())]

    assert run(read()) == [{"a": 1}, {"b": 2}]


# ------------------------------------------------------------------ 404 suggestions

def test_a_404_names_the_nearest_served_path():
    async def endpoint(request):
        return None

    routes = [Route(p, endpoint) for p in ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/tags",
                                           "/v1/models/{model_id:path}")]
    assert not_found_message("/v1/chat/completion", routes) == \
        "/v1/chat/completion is not served here: did you mean /v1/chat/completions?"
    assert nearest_path("/api/chats", ["/api/chat", "/api/tags"]) == "/api/chat"
    assert not_found_message("/zzzzzzzzzzzzzz", routes) == "/zzzzzzzzzzzzzz is not served here"
