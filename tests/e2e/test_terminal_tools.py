"""`tokenloom generate` and `tokenloom chat` in a real terminal (a pseudo-terminal), as a person uses them.

`generate` prints the answer as it is generated and nothing else; `chat` keeps log lines out of the
replies, Ctrl-C stops a reply and keeps the session, commands confirm what they did, `/help` lists them.
"""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "tokenloom.entrypoints.cli"]
LIGHT = ["--kv-cache-memory", "0.25", "--max-model-len", "1024"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A command on a pty: what it shows is read as it comes, with the time each piece came."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        master, slave = pty.openpty()
        env = dict(os.environ, OMP_NUM_THREADS="1", TERM="xterm")
        env.pop("TOKENLOOM_DEBUG", None)
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen([*CLI, *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, preexec_fn=ignore)
        os.close(slave)
        self.fd = master
        self.chunks: list[tuple[float, str]] = []

    @property
    def screen(self) -> str:
        return ANSI.sub("", "".join(c for _, c in self.chunks)).replace("\r\n", "\n")

    def read_until(self, pattern: str, timeout: float = 120, after: int = 0) -> str:
        """Read until `pattern` (a regex) shows up after character `after` of the screen."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.screen[after:]):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; screen:\n{self.screen}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the program exited
                    data = b""
                if not data:
                    assert re.search(pattern, self.screen[after:]), f"exited before {pattern!r}:\n{self.screen}"
                    break
                self.chunks.append((time.monotonic(), data.decode(errors="replace")))
        return self.screen

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def interrupt(self) -> None:
        """Ctrl-C, as the terminal sends it: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.fd)


@pytest.fixture(scope="module")
def generate_run():
    """One `generate` run, read to its end; the tests each check one property of it."""
    term = Terminal("generate", "Write three sentences about the sea.", "--max-tokens", "48", *LIGHT)
    deadline = time.monotonic() + 180
    while (term.proc.poll() is None or _drain(term)) and time.monotonic() < deadline:
        _drain(term, 0.2)
    try:
        yield term
    finally:
        term.close()


def _drain(term: Terminal, wait: float = 0.0) -> bool:
    """Read what is there (waiting up to `wait` s); False when nothing came."""
    ready, _, _ = select.select([term.fd], [], [], wait)
    if not ready:
        return False
    try:
        data = os.read(term.fd, 4096)
    except OSError:
        return False
    if data:
        term.chunks.append((time.monotonic(), data.decode(errors="replace")))
    return bool(data)


def test_generate_prints_only_the_answer(generate_run):
    assert generate_run.proc.returncode == 0, generate_run.screen
    text = generate_run.screen.strip()
    assert text
    for noise in ("INFO", "WARNING", "Loading", "Warming", "it/s", "tokens/s", "Traceback"):
        assert noise not in text, text


def test_generate_streams_the_answer_as_it_is_generated(generate_run):
    """The answer reaches the terminal in many pieces over time, not in one write at the end."""
    pieces = [(t, c) for t, c in generate_run.chunks if c.strip()]
    assert len(pieces) >= 5, pieces
    assert pieces[-1][0] - pieces[0][0] > 0.2, pieces


@pytest.fixture(scope="module")
def chat():
    term = Terminal("chat", "--max-tokens", "400", *LIGHT)
    term.read_until(r"you> ")
    yield term
    term.close()


def test_chat_help_lists_the_commands(chat):
    mark = len(chat.screen)
    chat.type("/help\n")
    shown = chat.read_until(r"you> ", after=mark)[mark:]
    for command in ("/help", "/reset", "/system", "/history", "/quit", "Ctrl-C"):
        assert command in shown, shown


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_session(chat):
    mark = len(chat.screen)
    chat.type("Tell me a very long story about a dragon and a knight, with many chapters.\n")
    chat.read_until(r"assistant> \S+ \S+ \S+", after=mark)
    chat.interrupt()
    shown = chat.read_until(r"\[reply stopped\][\s\S]*you> ", after=mark, timeout=30)[mark:]
    assert chat.proc.poll() is None, shown  # still running
    mark = len(chat.screen)
    chat.type("What is the capital of France?\n")
    shown = chat.read_until(r"assistant> [\s\S]*\nyou> ", after=mark)[mark:]
    assert "Paris" in shown, shown


def test_chat_replies_hold_no_log_lines(chat):
    for noise in ("INFO", "WARNING", "engine:", "tokens/s", "Traceback"):
        assert noise not in chat.screen, chat.screen


def test_chat_reset_says_what_it_did(chat):
    mark = len(chat.screen)
    chat.type("/reset\n")
    shown = chat.read_until(r"you> ", after=mark)[mark:]
    assert "conversation cleared" in shown, shown
    mark = len(chat.screen)
    chat.type("/history\n")
    assert "(the conversation is empty)" in chat.read_until(r"you> ", after=mark)[mark:]


def test_chat_system_command_confirms(chat):
    mark = len(chat.screen)
    chat.type("/system You answer in one word.\n")
    assert "system prompt set: You answer in one word." in chat.read_until(r"you> ", after=mark)[mark:]


def test_chat_ctrl_c_at_the_prompt_keeps_the_session(chat):
    mark = len(chat.screen)
    chat.interrupt()
    shown = chat.read_until(r"you> ", after=mark)[mark:]
    assert "/quit to leave" in shown
    assert chat.proc.poll() is None


def test_chat_quit_command_ends_with_exit_code_0(chat):
    chat.type("/quit\n")
    assert chat.proc.wait(timeout=30) == 0


def test_chat_started_with_sigint_ignored_still_answers_ctrl_c_at_the_prompt():
    """A parent that ignores SIGINT (a script's background job) passes that on; the chat takes Ctrl-C anyway."""
    term = Terminal("chat", *LIGHT, "--max-tokens", "8", sigint_ignored=True)
    try:
        mark = len(term.read_until(r"you> "))
        term.interrupt()
        assert "/quit to leave" in term.read_until(r"you> ", timeout=60, after=mark)[mark:]
        term.type("/quit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
