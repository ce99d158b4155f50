"""/v1/embeddings on the real server with the official `openai` client.

An embedding model served alone (all-MiniLM-L6-v2) answers every input shape, both encodings and usage;
refuses generation, unsupported `dimensions` and over-long or too many inputs with a clear 400; a generation
model refuses /v1/embeddings with a clear 400. The values themselves are checked against
sentence-transformers in test_embed_reference.py; here the server's equal the offline engine's.
"""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_harness import ServerProcess

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Embeddings are vectors."]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--num-blocks", "128", base_args=["--log-level", "warning"],
                        model="all-minilm-l6-v2")
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from tokenloom import LLM
    llm = LLM("all-minilm-l6-v2", progress=False, dtype="float32", device="cpu", num_blocks=64)
    yield {t: llm.embed(t)[0].outputs.embedding for t in TEXTS}
    llm.shutdown()


def test_every_input_shape_gives_the_offline_engines_embeddings(server, client, offline):
    one = client.embeddings.create(model=server.model, input=TEXTS[0])  # the client asks for base64
    many = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[1]}, timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model=server.model, input=tokens, encoding_format="float")
    by_id_lists = client.embeddings.create(model=server.model, input=[tokens, tokens], encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, d in zip(TEXTS, many.data):
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(offline[text]), atol=1e-5)
    assert torch.allclose(torch.tensor(one.data[0].embedding), torch.tensor(offline[TEXTS[0]]), atol=1e-5)
    for d in [by_ids.data[0], *by_id_lists.data]:
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(offline[TEXTS[1]]), atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(tokens) == by_ids.usage.total_tokens
    assert by_id_lists.usage.prompt_tokens == 2 * len(tokens)
    assert many.object == "list" and many.data[0].object == "embedding" and many.model == server.model


def test_base64_is_little_endian_float32(server):
    import base64

    import numpy as np
    body = {"input": "hello world"}
    floats = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=60).json()
    b64 = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_clear_400s(server):
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    err = _error(post("/v1/embeddings", {"input": "hi", "dimensions": 64}))
    assert err["param"] == "dimensions" and "does not support truncated embeddings" in err["message"]
    err = _error(post("/v1/embeddings", {"input": ["fine", "word " * 300]}))
    assert err["param"] == "input[1]" and err["code"] == "context_length_exceeded" and "256" in err["message"]
    err = _error(post("/v1/embeddings", {"input": ["x"] * 2049}))
    assert err["param"] == "input" and "2048" in err["message"]
    err = _error(post("/v1/embeddings", {"input": []}))
    assert err["param"] == "input"
    err = _error(post("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}))
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        err = _error(post(path, body))
        assert err["code"] == "model_not_generative" and "/v1/embeddings" in err["message"]


def test_a_generation_model_refuses_embeddings():
    srv = ServerProcess()
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        err = _error(r)
        assert err["code"] == "model_not_embedding" and "--runner pooling" in err["message"]
    finally:
        srv.terminate()
