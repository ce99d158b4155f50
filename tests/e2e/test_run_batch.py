"""`tokenloom run-batch` as a real subprocess on the embedded model: answers in input order, a malformed
line answered with an error line, the batch not stopped by it."""
from __future__ import annotations

import json

from test_cli import run_cli

LIGHT = ["--kv-cache-memory", "0.25", "--max-model-len", "1024"]


def test_run_batch_answers_every_line_in_order(tmp_path):
    lines = [
        json.dumps({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "max_tokens": 8, "temperature": 0}}),
        '{"custom_id": "broken", "method": "POST", ',
        json.dumps({"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}}),
        json.dumps({"custom_id": "resp-1", "method": "POST", "url": "/v1/responses",
                    "body": {"input": "Say hello.", "max_output_tokens": 4, "temperature": 0}}),
        json.dumps({"custom_id": "msg-1", "method": "POST", "url": "/v1/messages",
                    "body": {"model": "smollm2-135m-instruct", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "Say hello."}],
                             "temperature": 0}}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = run_cli("run-batch", "-i", str(src), "-o", str(out), *LIGHT)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat-1", None, "cmpl-1", "resp-1", "msg-1"]
    chat, broken, completion, response, message = results
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["content"]
    assert broken["response"] is None and broken["error"]["code"] == "invalid_json"
    assert "line 2" in broken["error"]["message"]
    assert completion["response"]["body"]["object"] == "text_completion"
    assert completion["response"]["body"]["usage"]["completion_tokens"] == 4
    assert response["response"]["body"]["object"] == "response"
    assert response["response"]["body"]["usage"]["output_tokens"] == 4
    assert message["response"]["body"]["type"] == "message"
    assert message["response"]["body"]["usage"]["output_tokens"] == 4
    assert "5/5" in proc.stderr  # the progress bar
