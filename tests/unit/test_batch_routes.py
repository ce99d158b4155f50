"""/v1/files, /v1/batches' checks and the in-process caller, on an app whose engine is not started
(the batches themselves run in tests/e2e/test_batches.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.app import ServerSettings, build_app
from tokenloom.entrypoints.openai.batch.endpoints import EndpointCaller
from tokenloom.entrypoints.openai.batch.settings import BatchSettings
from tokenloom.entrypoints.openai.server_state import ServerState

UPLOAD_LIMIT = 2000
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture
def client(tmp_path):
    engine = AsyncLLM(EngineConfig(), served_model_name="m")
    settings = ServerSettings(served_model_names=["m"], batch=BatchSettings(
        store_dir=tmp_path, max_upload_bytes=UPLOAD_LIMIT, max_requests=3))
    with TestClient(build_app(engine, settings)) as c:
        yield c


def upload(client, content: bytes, purpose: str = "batch"):
    return client.post("/v1/files", files={"file": ("in.jsonl", content, "application/jsonl")},
                       data={"purpose": purpose})


def test_a_file_is_uploaded_listed_read_and_deleted(client):
    content = (json.dumps(LINE) + "\n").encode()
    r = upload(client, content)
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["object"] == "file" and f["id"].startswith("file-") and f["bytes"] == len(content)
    assert f["filename"] == "in.jsonl" and f["purpose"] == "batch"
    assert client.get(f"/v1/files/{f['id']}").json() == f
    assert client.get(f"/v1/files/{f['id']}/content").content == content
    listed = client.get("/v1/files").json()
    assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [f["id"]]
    assert client.delete(f"/v1/files/{f['id']}").json() == {"id": f["id"], "object": "file", "deleted": True}
    r = client.get(f"/v1/files/{f['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"


def test_an_upload_over_the_limit_gets_413_in_openais_shape(client):
    r = upload(client, b"x" * (UPLOAD_LIMIT + 1))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and str(UPLOAD_LIMIT) in r.json()["error"]["message"]


def test_json_on_the_upload_route_says_what_it_wants(client):
    r = client.post("/v1/files", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_other_routes_still_refuse_multipart(client):
    r = client.post("/v1/chat/completions", files={"file": ("a", b"x")})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("data, files, param", [
    ({"purpose": "batch"}, None, "file"),
    ({}, {"file": ("a.jsonl", b"{}")}, "purpose"),
    ({"purpose": "nonsense"}, {"file": ("a.jsonl", b"{}")}, "purpose"),
])
def test_an_incomplete_upload_names_the_field(client, data, files, param):
    r = client.post("/v1/files", data=data, files=files or {"other": ("x", b"1")})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_batch_file_with_too_many_lines_is_refused(client):
    r = upload(client, b"{}\n" * 4)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_requests"


@pytest.mark.parametrize("body, status, param", [
    ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404,
     "input_file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/models", "completion_window": "24h"}, 400, "endpoint"),
    ({"input_file_id": "x", "endpoint": "/v1/completions", "completion_window": "1h"}, 400, "completion_window"),
    ({"endpoint": "/v1/completions"}, 400, "input_file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/completions", "metadata": {str(i): "v" for i in range(17)}}, 400,
     "metadata"),
])
def test_batch_creation_checks_name_the_field(client, body, status, param):
    r = client.post("/v1/batches", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_an_unknown_batch_is_404(client):
    assert client.get("/v1/batches/batch_nope").status_code == 404
    assert client.post("/v1/batches/batch_nope/cancel").status_code == 404
    assert client.get("/v1/batches").json()["data"] == []


def test_the_web_status_has_a_batches_section(client):
    # The snapshot needs a started engine; the section it adds is the runner's summary.
    assert client.app.state.ui_status.sections["batches"]() == []


@pytest.mark.parametrize("url, body, status, code", [
    ("/v1/models", {}, 400, "invalid_url"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, 400,
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 503, "engine_dead"),
])
def test_the_caller_answers_in_the_apis_shape_and_never_raises(url, body, status, code):
    caller = EndpointCaller(AsyncLLM(EngineConfig(), served_model_name="m"), ["m"], ServerState())
    answer = asyncio.run(caller.call(url, body))
    assert answer.status_code == status and answer.body["error"]["code"] == code, answer
