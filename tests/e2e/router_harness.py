"""Start the real `tokenloom router` as a subprocess on a free loopback port, for e2e tests.

The router is given `--port 0`; its "tokenloom router at http://HOST:PORT" line on stdout tells where it
listens. Its stderr goes to a log file that failing tests print.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time

import httpx
from server_harness import metric_values

_READY = re.compile(r"tokenloom router at (http://\S+)")


class RouterProcess:
    """`tokenloom router --port 0 ...` as a subprocess; `url` from its ready line."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="tokenloom-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenloom.entrypoints.cli", "router", "--port", "0",
                                      "--log-level", "warning", *args], stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.url = None
        deadline = time.time() + 60
        assert self.proc.stdout is not None
        while self.url is None:
            line = self.proc.stdout.readline()
            m = _READY.search(line or "")
            if m:
                self.url = m.group(1)
            elif not line or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"router did not start: {open(self.log.name).read()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        return metric_values(httpx.get(self.url + "/metrics", timeout=10).text)

    def workers(self) -> dict[str, bool]:
        return {w["url"]: w["healthy"] for w in httpx.get(self.url + "/workers", timeout=10).json()["workers"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
