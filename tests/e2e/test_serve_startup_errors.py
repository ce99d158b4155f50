"""`tokenloom serve` fails fast and in one line: the port is bound and the options checked before the
model loads; every start-up error is one `tokenloom: error: ...` line naming the cause, and `--debug`
shows the traceback instead."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokenloom.entrypoints.openai.api_server import _bind

SERVE = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", "--port", "0", "--num-blocks", "64",
         "--max-model-len", "512"]


def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TOKENLOOM_DEBUG", None)
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *mentions: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("tokenloom: starting the engine")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tokenloom: error:"), lines[0]
    assert "Traceback" not in proc.stderr
    for text in mentions:
        assert text in lines[0], lines[0]


@pytest.fixture
def corrupt_gguf(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return str(path)


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = run_serve("--port", str(port))
        elapsed = time.monotonic() - start
    assert_one_line_error(proc, f"127.0.0.1:{port}", "in use")
    assert "starting the engine" not in proc.stderr
    assert elapsed < 10, elapsed


def test_corrupt_gguf_fails_in_one_line(corrupt_gguf):
    assert_one_line_error(run_serve(corrupt_gguf), corrupt_gguf, "GGUF")


def test_unsupported_architecture_fails_in_one_line_naming_the_file_and_the_supported_ones(tmp_path):
    """A multimodal folder: its config has no text sizes at the top, and the class is what to report."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Idefics3ForConditionalGeneration"],
                                                      "text_config": {"hidden_size": 64}, "vision_config": {}}))
    save_file({"language_model.lm_head.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    proc = run_serve(str(tmp_path))
    assert_one_line_error(proc, str(tmp_path / "config.json"), "'Idefics3ForConditionalGeneration'",
                          "supported: ", "LlamaForCausalLM")


def test_missing_model_path_fails_in_one_line():
    assert_one_line_error(run_serve("/nonexistent/model.gguf"), "/nonexistent/model.gguf")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="gpu: needs a machine without CUDA")
def test_cuda_device_without_a_gpu_fails_in_one_line():
    assert_one_line_error(run_serve("--device", "cuda"), "--device cuda", "no CUDA device")


def test_unsupported_vllm_flag_fails_in_one_line_naming_it():
    assert_one_line_error(run_serve("--pipeline-parallel-size", "2"), "--pipeline-parallel-size",
                          "pipeline parallelism is not supported")


def test_a_missing_lora_adapter_fails_in_one_line_before_the_model_loads():
    proc = run_serve("--enable-lora", "--lora-modules", "a=/nonexistent/adapter")
    assert_one_line_error(proc, "--lora-modules a", "/nonexistent/adapter", "not a folder")
    assert "starting the engine" not in proc.stderr


def test_unknown_flag_fails_in_one_line_pointing_to_help():
    assert_one_line_error(run_serve("--no-such-flag"), "--no-such-flag", "tokenloom serve --help")


def test_bad_option_value_fails_in_one_line():
    assert_one_line_error(run_serve("--kv-cache-dtype", "int3"), "kv_cache_dtype", "int3")


def test_debug_shows_the_traceback(corrupt_gguf):
    proc = run_serve(corrupt_gguf, "--debug")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


def test_bound_socket_sets_tcp_nodelay_for_accepted_connections():
    """Streamed tokens are small writes; Nagle's algorithm would hold them back."""
    listener = _bind("127.0.0.1", 0)
    try:
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        client = socket.create_connection(listener.getsockname()[:2])
        conn, _ = listener.accept()
        try:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            conn.close()
            client.close()
    finally:
        listener.close()
