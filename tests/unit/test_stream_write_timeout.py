"""The streamed response's write timeout: a client that takes no chunk for the timeout
ends the stream, and the body generator is closed at once (which aborts the engine request).

The ASGI `send` here is what uvicorn's is for a client that stopped reading: it blocks until the
socket drains, which never happens. `receive` never reports a disconnect (the client is still
connected, just not reading).
"""
from __future__ import annotations

import asyncio
import time

from tokenloom.entrypoints.openai.streaming import DisconnectAwareStreamingResponse


def _run(response, send, timeout=10.0):
    async def receive():
        await asyncio.sleep(3600)

    async def main():
        await asyncio.wait_for(response({"type": "http"}, receive, send), timeout)

    asyncio.run(main())


def test_stalled_client_ends_the_stream_and_closes_the_body():
    closed = []
    produced = []

    async def body():
        try:
            for i in range(1000):
                produced.append(i)
                yield f"data: {i}\n\n"
        finally:
            closed.append(time.monotonic())

    sent = []

    async def send(message):
        sent.append(message["type"])
        if message["type"] == "http.response.body" and len(sent) > 3:
            await asyncio.sleep(3600)  # the client stopped reading: the socket never drains

    t0 = time.monotonic()
    _run(DisconnectAwareStreamingResponse(body(), write_timeout=0.3), send)
    assert closed, "the body generator was not closed"
    assert 0.3 <= closed[0] - t0 < 2.0
    assert len(produced) < 10  # the stream stopped; it did not run to the end


def test_reading_client_gets_the_whole_stream():
    async def body():
        for i in range(50):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n"

    chunks = []

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
        await asyncio.sleep(0.001)  # slow but reading

    _run(DisconnectAwareStreamingResponse(body(), write_timeout=0.3), send)
    assert len(chunks) == 50


def test_no_write_timeout_waits_for_the_client():
    async def body():
        yield "data: 1\n\n"
        yield "data: 2\n\n"

    got = []

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(0.5)  # longer than the other tests' timeout
            got.append(message["body"])

    _run(DisconnectAwareStreamingResponse(body(), write_timeout=None), send)
    assert got == [b"data: 1\n\n", b"data: 2\n\n"]
