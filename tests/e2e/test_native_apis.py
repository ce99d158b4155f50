"""Ollama's API through the official `ollama` client, llama-server's /completion and /props, and the 404 that
names the nearest path, on one light server (the details are unit tests: tests/unit/test_native_api_translation.py)."""
from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.e2e.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)
GREEDY = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "1024", "--num-blocks", "128")
    try:
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def test_chat_whole_and_streamed_agree(server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat(model=server.model, messages=messages, options={**GREEDY, "mirostat": 1}, stream=False)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 4 and whole.prompt_eval_count > 0 and whole.message.content
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.eval_duration > 0
    parts = list(client.chat(model=server.model + ":latest", messages=messages, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 4 and parts[-1].done_reason == "length"


def test_chat_format_schema_gives_json(server, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer = client.chat(model=server.model, messages=[{"role": "user", "content": "A number as JSON."}],
                         format=schema, options={"temperature": 0, "num_predict": 16})
    assert isinstance(json.loads(answer.message.content)["n"], int)


def test_generate_templated_and_raw(server, client):
    options = {**GREEDY, "num_predict": 2}
    templated = client.generate(model=server.model, prompt="Say hi.", system="Be brief.", options=options)
    streamed = list(client.generate(model=server.model, prompt="1, 2, 3,", raw=True, options=options, stream=True))
    assert templated.done and templated.response and streamed[-1].done and streamed[-1].eval_count == 2
    # no template around the raw prompt
    assert 0 < streamed[-1].prompt_eval_count < templated.prompt_eval_count
    assert "".join(p.response for p in streamed).strip()


def test_model_endpoints(server, client):
    tags = client.list()
    assert [m.model for m in tags.models] == [server.model + ":latest"]
    details = tags.models[0].details
    assert details.format == "gguf" and details.family == "llama" and details.parameter_size == "135M"
    assert tags.models[0].size > 0 and tags.models[0].digest
    show = client.show(server.model)
    assert show.modelinfo["llama.context_length"] == 1024 and "completion" in show.capabilities
    assert "im_start" in show.template
    assert client.ps().models[0].context_length == 1024
    assert httpx.get(server.url + "/api/version", timeout=30).json()["version"]


def test_ollama_errors(server, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="missing", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "missing" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=server.model, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=server.model, input="x")  # a generative model does not embed
    assert e.value.status_code == 400
    bad = httpx.post(server.url + "/api/chat", json={"model": server.model, "options": {"top_p": 5}}, timeout=30)
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]


def test_llamacpp_completion(server):
    body = {"prompt": "1, 2, 3,", "n_predict": 3, "temperature": 0}
    whole = server.post("/completion", json=body).json()
    assert whole["stop"] and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 3
    assert whole["tokens_evaluated"] > 0 and whole["timings"]["predicted_n"] == 3
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events][-1] and events[-1]["stop_type"] == "limit"
    tokens = server.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    assert server.post("/completion", json={**body, "prompt": tokens}).json()["content"] == whole["content"]


def test_llamacpp_grammar_and_json_schema(server):
    grammar = 'root ::= ("yes" | "no")'
    answer = server.post("/completion", json={"prompt": "Is water wet?", "n_predict": 4, "grammar": grammar}).json()
    assert answer["content"] in ("yes", "no") and answer["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer = server.post("/completion", json={"prompt": "JSON:", "n_predict": 16, "json_schema": schema}).json()
    assert isinstance(json.loads(answer["content"])["n"], int)
    bad = server.post("/completion", json={"prompt": "x", "grammar": "root ::= ("})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def test_llamacpp_props(server):
    props = server.get("/props").json()
    assert props["n_ctx"] == props["default_generation_settings"]["n_ctx"] == 1024
    assert props["total_slots"] > 0 and props["model_path"].endswith(".gguf") and props["chat_template"]


def test_a_404_names_the_nearest_path(server):
    openai_shape = server.post("/v1/chat/completion", json={})
    assert openai_shape.status_code == 404
    assert "did you mean /v1/chat/completions?" in openai_shape.json()["error"]["message"]
    ollama_shape = server.post("/api/chats", json={})
    assert ollama_shape.status_code == 404 and ollama_shape.json() == {
        "error": "/api/chats is not served here: did you mean /api/chat?"}
