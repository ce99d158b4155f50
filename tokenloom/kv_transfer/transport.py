"""The KV transport: a producer serves published blocks to one pull each over ZMQ (TCP or IPC).

A pull is one request/reply: a small msgspec header from the decoder, then a header and one frame per
(layer, half, run of consecutive blocks) back. The frames are memoryviews of the KV cache sent with
``copy=False``: no pickle, no serialization, no copy on the sending side (on CPU). Every size the other
side controls is bounded: requests by MAXMSGSIZE, replies by the exact byte count the decoder expects.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time

import msgspec
import torch
import zmq

from tokenloom.kv_transfer.blocks import block_runs, half_block_bytes, layout, run_views, write_runs

logger = logging.getLogger("tokenloom.kv_transfer")

MAX_REQUEST_BYTES = 64 * 1024  # a pull request is a few hundred bytes; anything larger is not ours
SEND_WAIT_S = 30.0  # how long the server waits for ZMQ to hand a reply's buffers to the network


class PullRequest(msgspec.Struct, kw_only=True):
    transfer_id: str
    identity: str  # the decoder's model identity: a different model never reads these blocks
    layout: str
    first_block: int
    num_blocks: int


class PullReply(msgspec.Struct, kw_only=True):
    error: str = ""
    runs: list[int] = []  # lengths of the runs of consecutive blocks, in frame order


class Published(msgspec.Struct):
    block_ids: list[int]
    deadline: float  # time.monotonic(): past it the blocks may be reused and are not served


class KVServer:
    """A ROUTER socket served by one thread. Published transfers are served once, then reported as sent."""

    def __init__(self, kv_caches: list[torch.Tensor], identity: str, ip: str, port: int, transport: str):
        self.kv_caches = kv_caches
        self.identity = identity
        self.layout = layout(kv_caches)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        if transport == "ipc":
            name = f"tokenloom-kv-{port or os.getpid()}.sock"
            self.address = f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
            self.sock.bind(self.address)
        elif port:
            self.address = f"tcp://{ip}:{port}"
            self.sock.bind(self.address)
        else:
            self.address = f"tcp://{ip}:{self.sock.bind_to_random_port(f'tcp://{ip}')}"
        self.lock = threading.Lock()  # guards published and sent; held while a reply's buffers are in use
        self.published: dict[str, Published] = {}
        self.sent: list[str] = []
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self.thread.start()

    def publish(self, transfer_id: str, block_ids: list[int], lease_s: float) -> None:
        with self.lock:
            self.published[transfer_id] = Published(list(block_ids), time.monotonic() + lease_s)

    def release(self, transfer_ids: list[str]) -> None:
        """Stop serving these (their lease ended); returns once no reply still reads their blocks."""
        with self.lock:
            for tid in transfer_ids:
                self.published.pop(tid, None)

    def take_sent(self) -> list[str]:
        with self.lock:
            sent, self.sent = self.sent, []
        return sent

    def close(self) -> None:
        self.closed.set()
        self.thread.join(5)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self.closed.is_set():
                if not poller.poll(100):
                    continue
                frames = self.sock.recv_multipart()
                if len(frames) != 3 or frames[1] != b"":
                    continue  # not a REQ peer
                try:
                    self._answer(frames[0], msgspec.msgpack.decode(frames[2], type=PullRequest))
                except msgspec.DecodeError:
                    self._reply(frames[0], PullReply(error="undecodable pull request"))
        except Exception:  # noqa: BLE001 - a broken server must not take the engine down; pulls then fail
            logger.exception("KV server stopped")
        finally:
            self.sock.close(0)

    def _reply(self, peer: bytes, reply: PullReply, buffers: list = ()):
        return self.sock.send_multipart([peer, b"", msgspec.msgpack.encode(reply), *buffers], copy=False, track=True)

    def _answer(self, peer: bytes, req: PullRequest) -> None:
        with self.lock:
            entry = self.published.get(req.transfer_id)
            error = ""
            if entry is None or entry.deadline < time.monotonic():
                error = f"unknown or expired transfer {req.transfer_id!r}"
            elif req.identity != self.identity or req.layout != self.layout:
                error = f"the decoder's model or KV layout ({req.layout}) differs from the producer's ({self.layout})"
            elif not 0 <= req.first_block or req.first_block + req.num_blocks != len(entry.block_ids):
                error = (f"asked for blocks {req.first_block}..{req.first_block + req.num_blocks - 1}, "
                         f"the transfer has {len(entry.block_ids)}")
            if error:
                self._reply(peer, PullReply(error=error))
                return
            runs = block_runs(entry.block_ids[req.first_block:])
            tracker = self._reply(peer, PullReply(runs=[n for _, n in runs]), run_views(self.kv_caches, runs))
            tracker.wait(SEND_WAIT_S)  # the blocks stay untouched until ZMQ no longer reads them
            del self.published[req.transfer_id]
            self.sent.append(req.transfer_id)


def pull(address: str, request: PullRequest, kv_caches: list[torch.Tensor], block_ids: list[int],
         timeout_s: float) -> str | None:
    """Fetch a transfer's blocks into `block_ids`; None on success, else why it failed (never hangs past
    timeout_s)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_REQUEST_BYTES, len(block_ids) * half_block_bytes(kv_caches)))
    try:
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            return f"no answer from {address} within {timeout_s:g} s"
        frames = sock.recv_multipart(copy=False)
        reply = msgspec.msgpack.decode(frames[0].buffer, type=PullReply)
        if reply.error:
            return reply.error
        return write_runs(kv_caches, reply.runs, [f.buffer for f in frames[1:]], block_ids)
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        return f"pull from {address} failed: {e}"
    finally:
        sock.close(0)
