"""The decoder's side of the KV transport: pulls run in one background thread, layer by layer.

`KVPuller.start` returns at once; the thread sends the request on the DEALER socket it keeps for that
producer (one per address, reused by every later pull) and writes each layer into the destination blocks as
its message arrives. A forward that computes on the pulled KV waits per layer (`wait_layer`: layer i runs
while layers > i still travel); a pull nobody waits for completes in the background and is reported by
`take_done`. Only the thread touches the sockets and decides a pull's fate (a timeout included), so no
layer is ever written after its pull was reported failed: the scheduler may reuse failed pulls' blocks.
"""
from __future__ import annotations

import itertools
import logging
import queue
import struct
import threading
import time

import msgspec
import torch
import zmq

from tokenloom.kv_transfer.blocks import write_layer
from tokenloom.kv_transfer.transport import LAYER, MAX_REQUEST_BYTES, PullReply, PullRequest

logger = logging.getLogger("tokenloom.kv_transfer")

_ids = itertools.count()


class Pull:
    """One transfer in flight. Its fields change in the puller's thread, under the puller's condition."""

    def __init__(self, key: str, address: str, request: PullRequest, block_ids: list[int], timeout_s: float):
        self.key = key
        self.address = address
        self.request = request
        self.block_ids = block_ids
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.runs: list[int] | None = None  # from the reply's header
        self.layers_done = 0
        self.wanted = -1  # the layer a forward waits for: the thread wakes it only once that layer is written
        self.error: str | None = None
        self.done = False  # every layer written, or failed (error set)


class KVPuller:
    def __init__(self, kv_caches: list[torch.Tensor]):
        self.kv_caches = kv_caches
        cache = kv_caches[0]
        # A frame holds at most one half of one layer: bounded by this cache's own size.
        self.max_frame = max(MAX_REQUEST_BYTES, cache[0].numel() * cache.element_size())
        self.ctx = zmq.Context.instance()
        self.cond = threading.Condition()
        self.finished: list[Pull] = []  # done or failed since the last take_done
        self.inbox: queue.SimpleQueue[Pull] = queue.SimpleQueue()
        self.wake_address = f"inproc://tokenloom-kv-puller-{next(_ids)}"
        self.wake = self.ctx.socket(zmq.PAIR)
        self.wake.bind(self.wake_address)
        self.woken = self.ctx.socket(zmq.PAIR)  # the thread's end, connected here so no wake-up is ever lost
        self.woken.connect(self.wake_address)
        self.wake_lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self.thread.start()

    # ---- the caller's side ---------------------------------------------------------------------
    def start(self, key: str, address: str, request: PullRequest, block_ids: list[int], timeout_s: float) -> Pull:
        pull = Pull(key, address, request, block_ids, timeout_s)
        self.inbox.put(pull)
        self._wake()
        return pull

    def wait_layer(self, pull: Pull, layer: int) -> None:
        """Until `layer` is written into the pull's blocks, or the pull has failed (timeouts included)."""
        with self.cond:  # the thread fails the pull at its deadline; the bound here only guards against a bug
            pull.wanted = layer
            self.cond.wait_for(lambda: pull.done or pull.layers_done > layer, pull.timeout_s + 5)
            pull.wanted = -1

    def wait_any(self, timeout_s: float) -> None:
        """Until some pull completes or fails, at most timeout_s (an idle engine waiting for KV, not spinning)."""
        with self.cond:
            self.cond.wait_for(lambda: self.finished, timeout_s)

    def take_done(self) -> list[Pull]:
        with self.cond:
            done, self.finished = self.finished, []
        return done

    def _wake(self) -> None:
        with self.wake_lock:
            try:
                self.wake.send(b"", zmq.NOBLOCK)  # never blocks: a full queue means the thread is awake anyway
            except zmq.ZMQError:
                pass  # closed, or the thread is gone: it fails what is left in the inbox, or polls within 100 ms

    def close(self) -> None:
        self.closed.set()
        self._wake()
        self.thread.join(5)
        with self.wake_lock:
            self.wake.close(0)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        wake = self.woken
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        sockets: dict[str, zmq.Socket] = {}
        pending: dict[bytes, Pull] = {}
        try:
            while not self.closed.is_set():
                now = time.monotonic()
                wait_ms = min([100.0] + [max(0.0, (p.deadline - now) * 1000) for p in pending.values()])
                for sock, _ in poller.poll(wait_ms):
                    if sock is wake:
                        while wake.poll(0):
                            wake.recv()
                        continue
                    self._drain(sock, pending)
                while not self.inbox.empty():
                    pull = self.inbox.get()
                    tid = pull.request.transfer_id.encode()
                    if tid in pending:
                        self._fail(pull, f"transfer {pull.request.transfer_id!r} is already being pulled")
                        continue
                    sock = sockets.get(pull.address)
                    if sock is None:
                        sock = sockets[pull.address] = self._connect(pull.address)
                        poller.register(sock, zmq.POLLIN)
                    try:
                        sock.send(msgspec.msgpack.encode(pull.request), zmq.NOBLOCK)
                    except zmq.Again:
                        self._fail(pull, f"cannot send to {pull.address}")
                        continue
                    pending[tid] = pull
                now = time.monotonic()
                for tid, pull in list(pending.items()):
                    if pull.deadline < now:
                        del pending[tid]
                        self._fail(pull, f"no answer from {pull.address} within {pull.timeout_s:g} s"
                                   if pull.runs is None else
                                   f"the transfer from {pull.address} did not complete within {pull.timeout_s:g} s")
        except Exception:  # noqa: BLE001 - a broken puller fails its pulls; the engine keeps running
            logger.exception("KV puller stopped")
        finally:
            for tid, pull in pending.items():
                self._fail(pull, "the KV puller stopped")
            while not self.inbox.empty():
                self._fail(self.inbox.get(), "the KV puller stopped")
            for sock in sockets.values():
                sock.close(0)
            wake.close(0)

    def _connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        sock.setsockopt(zmq.RCVHWM, 0)  # the thread drains every message as it comes
        sock.connect(address)
        return sock

    def _drain(self, sock: zmq.Socket, pending: dict[bytes, Pull]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            pull = pending.get(frames[0].bytes) if len(frames) >= 2 else None
            if pull is None:
                continue  # a late answer to a pull that already failed
            error = self._on_message(pull, frames[1:])
            if error:
                del pending[frames[0].bytes]
                self._fail(pull, error)
            elif pull.done:
                del pending[frames[0].bytes]

    def _on_message(self, pull: Pull, frames) -> str | None:
        try:
            if pull.runs is None:
                reply = msgspec.msgpack.decode(frames[0].buffer, type=PullReply)
                if reply.error:
                    return reply.error
                pull.runs = reply.runs
                return None
            (layer,) = LAYER.unpack(frames[0].bytes)
        except (msgspec.DecodeError, struct.error) as e:
            return f"undecodable answer from {pull.address}: {e}"
        if layer != pull.layers_done:
            return f"layer {layer} arrived, expected {pull.layers_done}"
        error = write_layer(self.kv_caches[layer], pull.runs, [f.buffer for f in frames[1:]], pull.block_ids)
        if error:
            return error
        with self.cond:
            pull.layers_done += 1
            if pull.layers_done == len(self.kv_caches):
                pull.done = True
                self.finished.append(pull)
                self.cond.notify_all()
            elif 0 <= pull.wanted < pull.layers_done:  # waking a waiter per layer costs ~0.1 ms of GIL each
                self.cond.notify_all()
        return None

    def _fail(self, pull: Pull, error: str) -> None:
        with self.cond:
            pull.error, pull.done = error, True
            self.finished.append(pull)
            self.cond.notify_all()


def pull(address: str, request: PullRequest, kv_caches: list[torch.Tensor], block_ids: list[int],
         timeout_s: float) -> str | None:
    """One pull, waited for: None on success, else why it failed (never hangs past timeout_s)."""
    puller = KVPuller(kv_caches)
    try:
        p = puller.start("", address, request, block_ids, timeout_s)
        puller.wait_layer(p, len(kv_caches) - 1)
        return p.error
    finally:
        puller.close()
