"""`tokenloom bench serve` against the real server on the embedded model: a tiny run, a
chat run on shared-prefix prompts, and a two-point sweep with a plot. Light settings (small
context and KV cache), few and short requests, so it stays quick on 2 CPU cores."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tokenloom_cmd() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "tokenloom"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tokenloom.entrypoints.cli"]


def _server_env() -> dict[str, str]:
    # One compute thread: on a small shared machine, threads spinning for cores that other
    # processes hold slow every step down far more than they help. Override with the variable.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-serve-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([*_tokenloom_cmd(), "serve", "--port", str(port), "--max-model-len", "1024",
                             "--kv-cache-memory", "0.25", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=_server_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy after 180 s:\n{Path(log.name).read_text()[-4000:]}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


def _bench(url: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*_tokenloom_cmd(), "bench", "serve", "--base-url", url, "--disable-tqdm", *args],
                          capture_output=True, text=True, timeout=timeout)


def _sane(run: dict, n: int, out_len: int | None = None) -> None:
    assert run["completed"] == n and run["failed"] == 0 and run["first_error"] is None
    assert run["duration_s"] > 0 and run["request_throughput"] > 0 and run["output_throughput"] > 0
    assert run["total_token_throughput"] > run["output_throughput"]
    if out_len is not None:
        assert run["total_output_tokens"] == n * out_len  # --ignore-eos: exactly max_tokens each
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = run[key]
        assert all(isinstance(d[k], float) and math.isfinite(d[k]) and d[k] > 0 for k in ("mean", "p50", "p90", "p99"))
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert run["ttft_ms"]["p50"] < run["e2el_ms"]["p99"]
    assert run["usage_missing"] == 0


def test_tiny_benchmark(server, tmp_path):
    out = tmp_path / "r.json"
    p = _bench(server, "--num-prompts", "6", "--input-len", "32", "--output-len", "8", "--max-concurrency", "3",
               "--ignore-eos", "--slo", "ttft=600000,tpot=600000", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    for label in ("Successful requests:", "P99 TTFT (ms):", "Mean TPOT (ms):", "P90 ITL (ms):", "P50 E2EL (ms):",
                  "Output token throughput (tok/s):", "Goodput"):
        assert label in p.stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["model"] == "smollm2-135m-instruct"  # found through GET /v1/models
    assert doc["config"]["tokens_per_word"] == pytest.approx(1.0, abs=0.2)
    (run,) = doc["runs"]
    _sane(run, 6, out_len=8)
    assert run["max_concurrency"] == 3 and run["good_requests"] == 6
    assert 6 * 28 <= run["total_input_tokens"] <= 6 * 36  # ~32 prompt tokens each, counted by the server
    assert len(run["requests"]) == 6 and all(r["success"] for r in run["requests"])


def test_chat_shared_prefix_reports_cached_tokens(server, tmp_path):
    out = tmp_path / "c.json"
    p = _bench(server, "--endpoint", "chat", "--dataset", "shared-prefix", "--num-groups", "1", "--prefix-len", "64",
               "--input-len", "8", "--output-len", "4", "--ignore-eos", "--num-prompts", "3",
               "--max-concurrency", "1", "--warmup", "1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warm-up: 1/1 requests succeeded" in p.stderr
    (run,) = json.loads(out.read_text())["runs"]
    _sane(run, 3, out_len=4)
    # the warm-up request put the 64-token system prompt in the prefix cache: every measured one reuses it
    assert all(r["cached_tokens"] >= 48 for r in run["requests"])
    assert run["cached_input_tokens"] >= 3 * 48


def test_sweep_with_plot(server, tmp_path):
    png, out = tmp_path / "sweep.png", tmp_path / "s.json"
    p = _bench(server, "--num-prompts", "2", "--input-len", "16", "--output-len", "4", "--ignore-eos",
               "--sweep", "1,2", "--plot", str(png), "--json", str(out), "--request-rate", "50", "--seed", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    for r in runs:
        _sane(r, 2, out_len=4)
    assert "TTFT p50" in p.stdout  # the sweep table


def test_unknown_model_is_reported_as_failures(server):
    p = _bench(server, "--model", "no-such-model", "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
               "--no-calibrate")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Failed requests:" in p.stdout and "first error: HTTP 404" in p.stdout


def test_sweep_points_get_fresh_prompts(server, tmp_path):
    """The second point would find the first point's prompts in the prefix cache if it reused them."""
    out = tmp_path / "f.json"
    p = _bench(server, "--num-prompts", "2", "--input-len", "64", "--output-len", "2", "--ignore-eos",
               "--sweep", "1,1", "--json", str(out), "--seed", "7")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "each point gets fresh prompts" in p.stderr
    first, second = json.loads(out.read_text())["runs"]
    assert second["cached_input_tokens"] == 0, second


def test_a_vllm_bench_serve_command_line_runs(server, tmp_path):
    """Flags as `vllm bench serve` spells them, on a ShareGPT-format file."""
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"id": str(i), "conversations": [
            {"from": "human", "value": f"Please name {i + 2} colours of the rainbow and say why the sky is blue."},
            {"from": "gpt", "value": "Red, orange, yellow. The sky is blue because air scatters blue light most."}]}
        for i in range(4)]))
    url = server.rsplit(":", 1)
    p = subprocess.run([*_tokenloom_cmd(), "bench", "serve", "--host", url[0].split("//")[1], "--port", url[1],
                        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                        "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", "2",
                        "--sharegpt-output-len", "4", "--goodput", "ttft:600000", "tpot:600000", "--save-result",
                        "--result-dir", str(tmp_path), "--result-filename", "vllm-style.json", "--disable-tqdm"],
                       capture_output=True, text=True, timeout=240, env=_server_env())
    assert p.returncode == 0, p.stdout + p.stderr
    (run,) = json.loads((tmp_path / "vllm-style.json").read_text())["runs"]
    _sane(run, 2, out_len=4)
    assert run["good_requests"] == 2
