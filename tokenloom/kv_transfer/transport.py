"""The KV transport: a producer serves published blocks to one pull each over ZMQ (TCP or IPC), layer by layer.

A pull is a small msgspec request from the decoder's DEALER socket; the producer's ROUTER answers with a
header message, then one message per layer holding one frame per (half, run of consecutive blocks). Every
message starts with the transfer id, so one DEALER per producer serves every pull to it, however many are in
flight, and a late answer to a pull that already timed out is recognised and dropped. The frames are
memoryviews of the KV cache sent with ``copy=False``: no pickle, no serialization, no copy on the sending side
(on CPU). Per-layer messages let the decoder use layer i while layers > i still travel (ZMQ delivers a
multipart message only whole). Every size the other side controls is bounded: requests by MAXMSGSIZE, replies
by the exact byte count the decoder expects for each frame.
"""
from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import time

import msgspec
import torch
import zmq

from tokenloom.kv_transfer.blocks import block_runs, layer_views, layout

logger = logging.getLogger("tokenloom.kv_transfer")

MAX_REQUEST_BYTES = 64 * 1024  # a pull request is a few hundred bytes; anything larger is not ours
SEND_WAIT_S = 30.0  # how long the server waits for ZMQ to hand a reply's buffers to the network
LAYER = struct.Struct("<I")


class PullRequest(msgspec.Struct, kw_only=True):
    transfer_id: str
    identity: str  # the decoder's model identity: a different model never reads these blocks
    layout: str
    first_block: int
    num_blocks: int
    tp_rank: int = 0  # the decoder's tensor-parallel rank and size: rank r pulls producer rank r's shard
    tp_size: int = 1


class PullReply(msgspec.Struct, kw_only=True):
    error: str = ""
    runs: list[int] = []  # lengths of the runs of consecutive blocks, in frame order


class Published(msgspec.Struct):
    block_ids: list[int]
    deadline: float  # time.monotonic(): past it the blocks may be reused and are not served


class KVServer:
    """A ROUTER socket served by one thread. Published transfers are served once, then reported as sent."""

    def __init__(self, kv_caches: list[torch.Tensor], identity: str, ip: str, port: int, transport: str,
                 tp_rank: int = 0, tp_size: int = 1):
        self.kv_caches = kv_caches
        self.identity = identity
        self.layout = layout(kv_caches)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # one message per layer per pull: never drop one (they are views)
        if transport == "ipc":
            name = f"tokenloom-kv-{port or os.getpid()}-{tp_rank}.sock"
            self.address = f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
            self.sock.bind(self.address)
        elif port:
            self.address = f"tcp://{ip}:{port + tp_rank}"  # rank r serves its shard on port + r
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
                if len(frames) != 2:
                    continue  # not one of our DEALER peers
                try:
                    req = msgspec.msgpack.decode(frames[1], type=PullRequest)
                except msgspec.DecodeError:
                    continue  # without a transfer id there is nobody to answer
                self._answer(frames[0], req)
        except Exception:  # noqa: BLE001 - a broken server must not take the engine down; pulls then fail
            logger.exception("KV server stopped")
        finally:
            self.sock.close(0)

    def _refusal(self, req: PullRequest, entry: Published | None) -> str:
        if req.tp_size != self.tp_size or req.tp_rank != self.tp_rank:
            return (f"tensor-parallel mismatch: the decoder's rank {req.tp_rank} of {req.tp_size} pulled from the "
                    f"producer's rank {self.tp_rank} of {self.tp_size} (both sides need the same TP size)")
        if entry is None or entry.deadline < time.monotonic():
            return f"unknown or expired transfer {req.transfer_id!r}"
        if req.identity != self.identity or req.layout != self.layout:
            return f"the decoder's model or KV layout ({req.layout}) differs from the producer's ({self.layout})"
        if not 0 <= req.first_block or req.first_block + req.num_blocks != len(entry.block_ids):
            return (f"asked for blocks {req.first_block}..{req.first_block + req.num_blocks - 1}, "
                    f"the transfer has {len(entry.block_ids)}")
        return ""

    def _answer(self, peer: bytes, req: PullRequest) -> None:
        tid = req.transfer_id.encode()
        with self.lock:
            entry = self.published.get(req.transfer_id)
            error = self._refusal(req, entry)
            if error:
                self.sock.send_multipart([peer, tid, msgspec.msgpack.encode(PullReply(error=error))])
                return
            runs = block_runs(entry.block_ids[req.first_block:])
            self.sock.send_multipart([peer, tid, msgspec.msgpack.encode(PullReply(runs=[n for _, n in runs]))])
            trackers = [self.sock.send_multipart([peer, tid, LAYER.pack(i), *layer_views(cache, runs)],
                                                 copy=False, track=True)
                        for i, cache in enumerate(self.kv_caches)]
            for tracker in trackers:  # the blocks stay untouched until ZMQ no longer reads them
                tracker.wait(SEND_WAIT_S)
            del self.published[req.transfer_id]
            self.sent.append(req.transfer_id)
