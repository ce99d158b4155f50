"""Start the real `tokenloom serve` as a subprocess on a free loopback port, for e2e tests.

The server is given `--port 0`; its one "tokenloom serving ... at http://HOST:PORT" line on
stdout tells where it listens. Its stderr goes to a log file that failing tests print.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

# Light settings: small context and KV cache, fine for 2 CPU cores. No admission by expected time: what a test
# may send must not depend on how busy the machine is (the admission tests set it themselves).
BASE_ARGS = ["--max-model-len", "2048", "--num-blocks", "256", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "512", "--log-level", "warning", "--max-expected-latency", "0"]
MODEL = "smollm2-135m-instruct"
_READY = re.compile(r"tokenloom serving (\S+) at (http://\S+)")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    def __init__(self, *extra_args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0,
                 base_args: list[str] | None = None, model: str = MODEL):
        self.log = tempfile.NamedTemporaryFile(prefix="tokenloom-server-", suffix=".log", delete=False)
        base = BASE_ARGS if base_args is None else base_args
        cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", model, "--port", "0", *base, *extra_args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=full_env, text=True)
        self.stdout_lines: list[str] = []
        self.url: str | None = None
        self.model: str | None = None
        ready = threading.Event()

        def read_stdout() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                m = _READY.search(line)
                if m and not ready.is_set():
                    self.model, self.url = m.group(1), m.group(2)
                    ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.time() + startup_timeout
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start (exit {self.proc.returncode}):\n{self.log_text()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_pids(self) -> list[int]:
        """The EngineCore processes (not other children such as the chat-template renderer)."""
        return [pid for pid in _children(self.proc.pid) if "tokenloom.engine.core_proc" in _cmdline(pid)]

    def child_pids(self) -> list[int]:
        return _children(self.proc.pid)

    def log_text(self) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=kw.pop("timeout", 120), **kw)

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        engines = self.child_pids() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in engines:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels without model_name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
        out[key] = float(value)
    return out


def stream_in_thread(url: str, body: dict, headers: dict | None = None) -> tuple[threading.Thread, dict]:
    """Start a streamed completion in a thread; the dict gets "status" and "events" (or "exception")."""
    out: dict = {}

    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                              timeout=120) as r:
                out["status"] = r.status_code
                out["events"] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        out["events"].append(payload if payload == "[DONE]" else json.loads(payload))
        except Exception as e:  # noqa: BLE001
            out["exception"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_idle(srv, timeout: float = 60.0, headers: dict | None = None) -> dict[str, float]:
    """Until the engine reports nothing running, waiting or holding KV blocks; returns the metrics."""
    deadline = time.time() + timeout
    while True:
        m = metric_values(httpx.get(srv.url + "/metrics", headers=headers, timeout=30).text)
        if (m.get("tokenloom:num_requests_running") == 0 and m.get("tokenloom:num_requests_waiting") == 0
                and m.get("tokenloom:kv_cache_used_blocks") == 0):
            return m
        assert time.time() < deadline, {k: v for k, v in m.items() if "num_requests" in k or "blocks" in k}
        time.sleep(0.3)
