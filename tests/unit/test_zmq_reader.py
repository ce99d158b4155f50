"""SocketReader: a plain ZMQ socket's messages awaited in an asyncio loop (tokenloom/engine/zmq_reader.py)."""
from __future__ import annotations

import asyncio

import zmq

from tokenloom.engine.zmq_reader import SocketReader


def _pair(ctx: zmq.Context, tmp_path):
    addr = f"ipc://{tmp_path}/out.sock"
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    return push, pull


def _run(tmp_path, body):
    ctx = zmq.Context()
    push, pull = _pair(ctx, tmp_path)

    async def main():
        reader = SocketReader(pull, asyncio.get_running_loop())
        try:
            return await body(push, reader)
        finally:
            reader.close()
    try:
        return asyncio.run(main())
    finally:
        push.close(0), pull.close(0), ctx.term()


def test_messages_already_queued_come_back_together_in_order(tmp_path):
    async def body(push, reader):
        for i in range(5):
            push.send(b"m%d" % i)
        got = []
        while len(got) < 5:
            got += await reader.receive(timeout=5)
        return got
    assert _run(tmp_path, body) == [b"m0", b"m1", b"m2", b"m3", b"m4"]


def test_receive_waits_for_a_message_sent_later(tmp_path):
    async def body(push, reader):
        asyncio.get_running_loop().call_later(0.05, push.send, b"late")
        return await reader.receive(timeout=5)
    assert _run(tmp_path, body) == [b"late"]


def test_a_receive_that_times_out_returns_nothing(tmp_path):
    async def body(push, reader):
        return await reader.receive(timeout=0.05)
    assert _run(tmp_path, body) == []


def test_every_message_of_a_long_stream_arrives_once(tmp_path):
    """Sent from another thread while the loop waits: no message lost between a drain and the next wait."""
    import threading

    async def body(push, reader):
        sender = threading.Thread(target=lambda: [push.send(b"%d" % i) for i in range(2000)])
        sender.start()
        got = []
        while len(got) < 2000:
            batch = await reader.receive(timeout=5)
            assert batch, "a message was sent but the reader timed out"
            got += batch
        sender.join()
        return got
    assert _run(tmp_path, body) == [b"%d" % i for i in range(2000)]
