"""Render chat templates sent with a request in a separate process, with memory and time limits.

Why a process: a template is code. The sandbox (chat_template.py) bounds what it can
build, but a render in the API process shares its GIL, memory and event loop with every
other request; a template that slips past a bound (a long C-level loop, a string grown in
steps) would stall or bloat the server for everyone. Here it runs in one child process:

* its address space is capped at its size after start-up plus `MEMORY_LIMIT_BYTES`
  (an allocation beyond that fails with MemoryError, answered as a template error);
* a render that runs longer than `chat_template.MAX_RENDER_SECONDS` gets the child
  killed (SIGKILL) and a fresh one is started for the next render;
* renders are serialized through one child (only requests that bring their own template
  use it; the model's own template renders in-process).

`render_untrusted` blocks: call it off the event loop (asyncio.to_thread).
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from tokenloom.tokenizer.chat_template import MAX_RENDER_SECONDS, ChatTemplateError, render_chat_template

# Headroom above the child's own footprint: the output cap is 4 Mi characters (up to 16 MiB as
# str), so 256 MiB leaves room for every legitimate intermediate and stops the 300 MB allocation
# the adversarial probe made.
MEMORY_LIMIT_BYTES = 256 * 2 ** 20
# Start-up of a fresh child (spawn + imports) takes ~0.3 s on this machine; allow for load.
START_TIMEOUT_S = 30.0


def _child(conn: Connection) -> None:
    """The child's loop: (template, messages, kwargs) in, ("ok", text) or ("error", message) out."""
    with open("/proc/self/statm") as f:
        vm_pages = int(f.read().split()[0])
    limit = vm_pages * os.sysconf("SC_PAGE_SIZE") + MEMORY_LIMIT_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            template, messages, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", render_chat_template(template, messages, **kwargs)))
        except MemoryError:
            conn.send(("error", "the chat template used more memory than allowed"))
        except ChatTemplateError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001 - reported as a template error
            conn.send(("error", f"chat template failed: {type(e).__name__}: {e}"))


class TemplateProcess:
    """One child process rendering untrusted templates (started on first use, replaced when killed)."""

    def __init__(self, timeout: float = MAX_RENDER_SECONDS) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child,), name="tokenloom-template", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            proc.kill()
            proc.join()
            raise ChatTemplateError("the template renderer did not start")
        parent.recv()
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def render(self, template: str, messages: Sequence[object], **kwargs: object) -> str:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
            try:
                self._conn.send((template, messages, kwargs))
                ready = self._conn.poll(self.timeout)
                status, value = self._conn.recv() if ready else (None, None)
            except (EOFError, OSError):
                self._kill()
                raise ChatTemplateError("the chat template renderer died (memory limit)") from None
            if status is None:
                self._kill()
                raise ChatTemplateError(f"chat template rendering took longer than {self.timeout:g} s")
            if status == "error":
                raise ChatTemplateError(value)
            return value

    def close(self) -> None:
        with self._lock:
            self._kill()


_PROCESS: TemplateProcess | None = None
_PROCESS_LOCK = threading.Lock()


def render_untrusted(template: str, messages: Sequence[object], **kwargs: object) -> str:
    """`render_chat_template(template, messages, **kwargs)` in the limited child process."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = TemplateProcess()
    return _PROCESS.render(template, messages, **kwargs)
