"""/v1/files and /v1/batches on the real server, driven by the official openai client: a batch runs to
completed with its output and error files, a cancel, a too-large upload, and a server stopped mid-batch
(SIGTERM) whose successor on the same store finishes the batch with every request answered exactly once.
"""
from __future__ import annotations

import json
import time

import openai
import pytest
from server_harness import ServerProcess

from tokenloom.entrypoints.openai.batch.store import BatchStore

LIGHT = ["--max-model-len", "1024", "--num-blocks", "128"]
UPLOAD_LIMIT = 20_000
QUESTIONS = ["What is the capital of France?", "Name a color.", "Say hello."]


def chat_line(custom_id: str, content: str, max_tokens: int = 6, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 60.0):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.time() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


RESTART_LINES = [chat_line(f"r{i}", f"Count to {i + 5}.", max_tokens=8, ignore_eos=True) for i in range(4)]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-store")


@pytest.fixture(scope="module")
def interrupted_batch(store_dir) -> str:
    """A batch whose server was stopped (SIGTERM) after its first result: one request at a time, so the
    rest is still to do. The module's server, started next on the same store, must finish it."""
    first = ServerProcess(*LIGHT, "--batch-store-dir", str(store_dir), "--batch-concurrency", "1")
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0, timeout=60)
        uploaded = client.files.create(file=("in.jsonl", jsonl(RESTART_LINES)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.time() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            assert time.time() < deadline, first.log_text()
            time.sleep(0.05)
    finally:
        assert first.terminate() == 0, first.log_text()
    store = BatchStore(store_dir)
    finished, _ = store.result_counts(batch.id)
    store.close()
    assert 1 <= finished < len(RESTART_LINES), "the batch was not stopped midway: make it slower"
    return batch.id


@pytest.fixture(scope="module")
def server(store_dir, interrupted_batch):
    srv = ServerProcess(*LIGHT, "--batch-store-dir", str(store_dir), "--max-upload-bytes", str(UPLOAD_LIMIT))
    try:
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_batch_runs_to_completed_with_its_output_and_error_files(server, client):
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}})
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "e2e"})
    assert batch.id.startswith("batch_") and batch.metadata == {"job": "e2e"}
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    answers = output_lines(client, done.output_file_id)
    assert [a["custom_id"] for a in answers] == ["q0", "q1", "q2"]
    for a in answers:
        body = a["response"]["body"]
        assert a["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] <= 6
    errors = output_lines(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["response"]["status_code"] == 400
    assert batch.id in [b.id for b in client.batches.list()]
    shown = {b["id"]: b for b in server.get("/ui/api/status").json()["batches"]}
    assert (shown[batch.id]["completed"], shown[batch.id]["failed"], shown[batch.id]["total"]) == (3, 1, 4)


def test_a_cancelled_batch_stops(client):
    lines = [chat_line(f"long{i}", "Tell me a long story.", max_tokens=400, ignore_eos=True) for i in range(6)]
    uploaded = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_for(client, batch.id, ("cancelled",), timeout=30)
    assert done.request_counts.completed < 6 and done.cancelled_at is not None
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_too_large_upload_gets_a_clear_error(client):
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (UPLOAD_LIMIT + 1)), purpose="batch")
    assert caught.value.status_code == 413
    assert f"the limit is {UPLOAD_LIMIT} bytes" in caught.value.message


def test_a_batch_survives_a_restart(client, interrupted_batch):
    """Stopped mid-batch, the server kept what finished; the next one on the same store did the rest."""
    done = wait_for(client, interrupted_batch, ("completed", "failed"))
    assert done.status == "completed"
    total = len(RESTART_LINES)
    assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
    answers = output_lines(client, done.output_file_id)
    assert [a["custom_id"] for a in answers] == [f"r{i}" for i in range(total)]  # each once, in input order
    assert all(a["response"]["body"]["usage"]["completion_tokens"] == 8 for a in answers)
