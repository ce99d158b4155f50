"""The `tokenloom` command line, run as a real subprocess on the embedded model.

`generate` and `chat` answer a question; a bad model path or a corrupt model file ends with one
`tokenloom: error: ...` line on stderr and a non-zero exit, never a traceback. Light settings (small KV
cache, few tokens, one compute thread) keep each run to a few seconds on 2 CPU cores.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

CLI = [sys.executable, "-m", "tokenloom.entrypoints.cli"]
LIGHT = ["--kv-cache-memory", "0.25", "--max-tokens", "24"]
QUESTION = "What is the capital of France?"


def run_cli(*args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TOKENLOOM_DEBUG", None)  # tracebacks only on request
    return subprocess.run([*CLI, *args], input=input, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=None if input is not None else subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *mentions: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tokenloom: error:"), lines[0]
    for text in mentions:
        assert text in lines[0]


@pytest.fixture(scope="module")
def generated() -> subprocess.CompletedProcess:
    """One `generate` run, shared by the tests that each check one property of it."""
    return run_cli("generate", QUESTION, "--quiet", *LIGHT)


def test_generate_answers_the_question(generated):
    assert generated.returncode == 0, generated.stderr
    assert "Paris" in generated.stdout
    assert "Traceback" not in generated.stderr


def test_generate_prints_only_the_answer_on_stdout(generated):
    """Logs and progress go to stderr, so the output can be piped."""
    assert generated.returncode == 0, generated.stderr
    assert not any(line.startswith(("INFO", "WARNING")) for line in generated.stdout.splitlines())
    assert "\r" not in generated.stderr  # --quiet: no progress bars


def test_generate_with_a_missing_model_path_fails_in_one_line():
    proc = run_cli("generate", "x", "--model", "/nonexistent", *LIGHT)
    assert_one_line_error(proc, "/nonexistent")
    assert proc.stdout == ""


@pytest.mark.parametrize("content", ["random bytes", "magic only"])
def test_generate_with_a_corrupt_gguf_fails_in_one_line(tmp_path, content):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes({
        "random bytes": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "magic only": b"GGUF\x03\x00\x00\x00garbage",
    }[content])
    proc = run_cli("generate", "x", "--model", str(path), *LIGHT)
    assert_one_line_error(proc, str(path))
    assert proc.stdout == ""


def test_chat_answers_a_question_after_an_empty_line_and_ends_at_end_of_input():
    """A stray Enter does not end the conversation: the question after it is answered."""
    proc = run_cli("chat", "--quiet", *LIGHT, input=f"\n{QUESTION}\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    reply = proc.stdout.split("assistant>", 1)[1]
    assert "Paris" in reply


def test_chat_ends_cleanly_at_end_of_input():
    """Ctrl-D (EOF) without any question: exit 0, nothing generated."""
    proc = run_cli("chat", "--quiet", *LIGHT, input="")
    assert proc.returncode == 0, proc.stderr
    assert "assistant>" not in proc.stdout
    assert "Traceback" not in proc.stderr
