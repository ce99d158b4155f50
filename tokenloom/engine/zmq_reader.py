"""Receiving a ZMQ socket's messages in an asyncio loop without a Future per message.

The API process receives one message from the engine per engine step: at concurrency 1, one per token.
pyzmq's asyncio socket makes a Future for each `await recv()`, registers and unregisters its interest,
and reads the socket's event flags through its Python option layer: py-spy put about a third of the
API event loop's time there, while the process took ~1 ms of CPU a streamed token, CPU the engine's two
threads lose on a 2-core machine (docs/performance.md, "The batch-1 step").

Here the socket is a plain one. The loop watches its ZMQ_FD, which becomes readable when messages may
have arrived; each wake-up reads every queued message without blocking, until EAGAIN (libzmq clears the
FD's signal as it processes them, so the next message signals it again).
"""
from __future__ import annotations

import asyncio

import zmq


class SocketReader:
    """Await batches of messages from a plain (non-asyncio) ZMQ socket that only this reader reads."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop):
        self._sock = sock
        self._loop = loop
        self._fd = sock.getsockopt(zmq.FD)
        self._signalled = asyncio.Event()
        loop.add_reader(self._fd, self._signalled.set)

    def _drain(self) -> list[bytes]:
        messages = []
        while True:
            try:
                messages.append(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    async def receive(self, timeout: float | None = None) -> list[bytes]:
        """The messages queued now, or the next ones to arrive; [] when `timeout` seconds pass first."""
        while True:
            messages = self._drain()
            if messages:
                return messages
            self._signalled.clear()
            messages = self._drain()  # one that came between the drain and the clear signalled already
            if messages:
                return messages
            try:
                await asyncio.wait_for(self._signalled.wait(), timeout)
            except asyncio.TimeoutError:
                return []

    def close(self) -> None:
        """Stop watching the socket (the caller closes it)."""
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
