"""`tokenloom chat`: one conversation in the terminal.

Ctrl-C while a reply is being written stops that reply (the request is aborted in the engine
between two steps, never in the middle of one) and the session goes on; Ctrl-C at the prompt
only clears the line. Ctrl-D, /quit or an empty line end the session. Each command says
what it did.
"""
from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.entrypoints.terminal import chat_prompt_ids, stream_reply

if TYPE_CHECKING:  # the LLM imports torch; the session only calls it
    from tokenloom.entrypoints.llm import LLM

HELP = """commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /system [TEXT]  set the system prompt (no TEXT: remove it); the conversation is kept
  /history        show the conversation so far
  /quit           leave (also Ctrl-D or an empty line)
Ctrl-C stops the reply being written."""


class ChatSession:
    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None, out: TextIO | None = None,
                 err: TextIO | None = None, lora_request: LoRARequest | None = None) -> None:
        self.llm = llm
        self.params = params
        self.lora_request = lora_request  # the LoRA adapter every reply uses (--lora)
        self.system = system
        self.turns: list[dict[str, str]] = []
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._interrupted = False

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def run(self) -> int:
        # An interactive session always takes Ctrl-C, even when started with SIGINT ignored (inherited from a
        # parent that ignores it: a background job of a script, some launchers); Python then leaves it ignored,
        # and Ctrl-C at the prompt would do nothing.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return self._loop()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _loop(self) -> int:
        self.say("tokenloom chat: type a message; /help lists the commands, Ctrl-D leaves")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print(file=self.err)
                return 0
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /quit to leave)")
                continue
            if not line or line in ("/quit", "/exit"):
                return 0
            if line.startswith("/"):
                self.command(line)
                continue
            self.reply(line)

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            n = len(self.turns) // 2
            self.turns = []
            self.say(f"conversation cleared ({n} exchange{'s' if n != 1 else ''} forgotten)")
        elif name == "/system":
            self.system = arg or None
            self.say(f"system prompt set: {arg}" if arg else "system prompt removed")
        elif name == "/history":
            for m in self.messages():
                self.say(f"{m['role']}: {m['content']}")
            if not self.messages():
                self.say("(the conversation is empty)")
        else:
            self.say(f"unknown command {name}; /help lists the commands")

    def reply(self, line: str) -> None:
        self.turns.append({"role": "user", "content": line})
        print("assistant> ", end="", file=self.out, flush=True)
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            text, stopped = stream_reply(self.llm, chat_prompt_ids(self.llm, self.messages()), self.params,
                                    out=self.out, stop=lambda: self._interrupted, lora_request=self.lora_request)
        finally:
            signal.signal(signal.SIGINT, previous)
        print(file=self.out, flush=True)
        if stopped:
            self.say("[reply stopped]")
        self.turns.append({"role": "assistant", "content": text})

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupted = True
