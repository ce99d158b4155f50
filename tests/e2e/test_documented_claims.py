"""Claims of the documentation (docs/serving.md, docs/structured-outputs.md, docs/benchmarks.md) that no
other test covers, each checked end to end:
`serve` start-up errors in one line, structural_tag on its own, request logs, streamed
reasoning_content, `bench throughput`, and tracing off by default. (Tool-choice auto / required / none and
parallel_tool_calls are in test_tool_calls.py.)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from server_harness import ServerProcess

CLI = [sys.executable, "-m", "tokenloom.entrypoints.cli"]
LIGHT = ["--num-blocks", "64", "--max-model-len", "256"]


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TOKENLOOM_DEBUG", None)
    return subprocess.run([*CLI, "serve", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def _error_lines(stderr: str) -> list[str]:
    """The server's own lines on stderr but its progress notices (no progress bars, logs, warnings)."""
    return [line for line in stderr.splitlines() if line.startswith("tokenloom:")
            and not line.startswith(("tokenloom: starting the engine", "tokenloom: engine ready"))]


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("case", ["missing model", "bad value", "unknown parser", "port in use"])
def test_serve_startup_errors_are_one_line(case, request):
    args = {"missing model": ["/nonexistent-model", *LIGHT],
            "bad value": ["smollm2-135m-instruct", "--max-model-len", "-1"],
            "unknown parser": ["smollm2-135m-instruct", "--tool-call-parser", "nope"],
            }.get(case)
    mention = {"missing model": "/nonexistent-model", "bad value": "max_model_len",
               "unknown parser": "tool_call_parser", "port in use": "cannot listen"}[case]
    if case == "port in use":
        port = request.getfixturevalue("busy_port")
        args = ["smollm2-135m-instruct", *LIGHT, "--port", str(port)]
    proc = _serve(*args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("tokenloom:"), lines
    assert mention in lines[0], lines[0]


# ---------------------------------------------------------------- one server

@pytest.fixture(scope="module")
def server():
    # PYTHONPROFILEIMPORTTIME: every process of the server writes each module it imports, when it
    # imports it, to its stderr (the log): what the tracing test reads.
    srv = ServerProcess("--reasoning-parser", "think", "--log-requests", "full", "--log-level", "info",
                        env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        yield srv
    finally:
        srv.terminate()


def test_structural_tag_on_its_own(server):
    """response_format structural_tag: the output is the tag's begin, JSON valid for its schema, its end."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                                "content": {"type": "json_schema", "json_schema": schema}}}
    r = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Which city is the capital of France?"}],
        "max_tokens": 40, "temperature": 0, "response_format": tag})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    assert json.loads(text[len("<answer>"):-len("</answer>")])["city"] in ("Paris", "Rome")


def test_streamed_reasoning_content_matches_the_whole_answer(server):
    """With --reasoning-parser think, the thinking goes to reasoning_content, streamed as deltas that join
    to the non-streamed field, and the answer to content."""
    body = {"messages": [{"role": "user", "content": "Pick one."}, {"role": "assistant", "content": "<think>\n"}],
            "add_generation_prompt": False, "continue_final_message": True, "temperature": 0, "max_tokens": 30,
            "thinking_token_budget": 6, "guided_choice": ["left", "right"]}
    whole = server.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert whole["reasoning_content"] and whole["content"] in ("left", "right"), whole
    r = server.post("/v1/chat/completions", json={**body, "stream": True})
    reasoning = content = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])


def test_request_logs_say_received_timings_and_output(server):
    r = server.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0,
                                            "request_id": "log-check-1"})
    assert r.status_code == 200
    text = r.json()["choices"][0]["text"]
    deadline = time.time() + 10
    while "request log-check-1 finished" not in _whole_log(server):
        assert time.time() < deadline, server.log_text()[-2000:]
        time.sleep(0.1)
    lines = [line for line in _whole_log(server).splitlines() if "log-check-1" in line]
    received = next(line for line in lines if "received" in line)
    finished = next(line for line in lines if "finished" in line)
    assert "prompt tokens" in received and "prompt='The sky is'" in received
    assert "(length): " in finished and "3 generated tokens" in finished
    assert "queued" in finished and "prefill" in finished and "decode" in finished  # stages
    assert repr([text]) in finished  # full: the output text


# ---------------------------------------------------------------- bench throughput

@pytest.mark.slow  # ~20-40 s of engine load and generation on 2 cores
def test_bench_throughput_reports_rates(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    proc = subprocess.run([*CLI, "bench", "throughput", "--num-prompts", "4", "--input-len", "16",
                           "--output-len", "8", "--decode-profile", "0", *LIGHT, "--json", str(out)],
                          capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (4, 16, 8)
    assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > result["output_tokens_per_s"]
    # 4 prompts x 8 output tokens in the elapsed time: the rates are consistent with each other
    assert abs(result["output_tokens_per_s"] * result["elapsed_s"] - 32) < 0.5
    assert "output tokens/s" in proc.stdout + proc.stderr


def _whole_log(server: ServerProcess) -> str:
    with open(server.log.name, errors="replace") as f:
        return f.read()


def _imported_modules(server: ServerProcess) -> set[str]:
    """The modules the server's processes imported so far, from their -X importtime lines
    ("import time: SELF | CUMULATIVE | NAME", the name indented by its depth)."""
    return {line.rsplit("|", 1)[1].strip() for line in _whole_log(server).splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


# What tracing loads when it is on (tracing.py): the OpenTelemetry SDK and an OTLP exporter. The API
# package alone (`opentelemetry`, `opentelemetry.trace`) is imported by FastAPI itself (fastapi.telemetry).
TRACING_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter")


def test_tracing_is_not_loaded_without_the_flag(server):
    """No cost when off: having served requests, no process of the server has loaded the OpenTelemetry SDK
    or an exporter."""
    r = server.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 2})
    assert r.status_code == 200
    modules = _imported_modules(server)
    # the log does record the server's imports, the module that would load the SDK among them
    assert {"uvicorn", "tokenloom.tracing", "torch"} <= modules  # torch: the engine process's imports too
    assert not {m for m in modules if m.startswith(TRACING_PACKAGES)}
