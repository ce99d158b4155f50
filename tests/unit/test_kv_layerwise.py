"""A KV connector's per-layer hooks: where the engine calls them in a real forward, and the ZMQ transport's
per-layer streaming (layer i is usable while later layers still travel) over one reused socket."""
from __future__ import annotations

import threading

import msgspec
import torch
import zmq
from helpers import greedy_params, make_request, random_prompts

from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.kv_metadata import KVConnectorMetadata
from tokenloom.kv_transfer.blocks import block_runs, layer_views, layout
from tokenloom.kv_transfer.puller import KVPuller
from tokenloom.kv_transfer.transport import LAYER, PullReply, PullRequest
from tokenloom.kv_transfer.worker_hook import ConnectorHook
from tokenloom.worker.runner import ModelRunner

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 8, 4, 2, 8


class Recorder(WorkerConnector):
    """Notes, at each hook, whether each layer already holds the step's KV in the request's blocks."""

    def __init__(self, caches: list[torch.Tensor]):
        self.caches = caches
        self.block_ids: list[int] = []
        self.events: list = []

    def written(self) -> list[bool]:
        return [bool(c[:, self.block_ids].any()) for c in self.caches]

    def start_load_kv(self, meta):
        self.events.append(("start", self.written()))

    def has_layer_work(self):
        return True

    def wait_for_layer_load(self, layer):
        self.events.append(("load", layer, self.written()))

    def save_kv_layer(self, layer):
        self.events.append(("save", layer, self.written()))

    def wait_for_save(self, meta, requests):
        self.events.append(("saved", self.written()))


def test_each_layer_is_loaded_before_it_runs_and_saved_right_after_it_wrote_its_kv(make_core):
    core = make_core("llama")
    engine_runner = core.executor.worker.runner
    recorder = Recorder(engine_runner.kv_caches)
    # A runner built with the connector (its hooks are the runner's own, from construction on).
    runner = ModelRunner(engine_runner.model, engine_runner.kv_caches, engine_runner.block_size, engine_runner.device,
                         engine_runner.attention, kv_connector=ConnectorHook(recorder))
    core.add_request(make_request("r", random_prompts(1, [9], 512, seed=1)[0], greedy_params(1)))
    step = core.scheduler.schedule()
    step.kv_connector = KVConnectorMetadata(poll=True)
    recorder.block_ids = core.scheduler.requests["r"].block_ids
    runner.execute(step)
    n = len(recorder.caches)
    none, upto = [False] * n, lambda i: [j < i for j in range(n)]
    expected = [("start", none)]
    for layer in range(n):
        expected.append(("load", layer, upto(layer)))  # layer i's cache untouched when its load is waited for
        expected.append(("save", layer, upto(layer + 1)))  # layer i's KV written, layer i+1's not yet
    expected.append(("saved", [True] * n))
    assert recorder.events == expected
    step.kv_connector = None  # a step without connector work runs the plain caches: no hook is called
    runner.execute(step)
    assert recorder.events == expected


def _caches(seed: int | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=g) if g else torch.zeros(2, BLOCKS, BS, HEADS, DIM)
            for _ in range(LAYERS)]


class ScriptedProducer:
    """A producer socket the test drives by hand: it answers a pull's header and layers when told to."""

    def __init__(self):
        self.caches = _caches(0)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def receive(self) -> tuple[bytes, PullRequest]:
        assert self.sock.poll(5000)
        peer, body = self.sock.recv_multipart()
        return peer, msgspec.msgpack.decode(body, type=PullRequest)

    def send_header(self, peer: bytes, req: PullRequest, block_ids: list[int]) -> None:
        runs = [n for _, n in block_runs(block_ids)]
        self.sock.send_multipart([peer, req.transfer_id.encode(), msgspec.msgpack.encode(PullReply(runs=runs))])

    def send_layer(self, peer: bytes, req: PullRequest, block_ids: list[int], layer: int) -> None:
        views = layer_views(self.caches[layer], block_runs(block_ids))
        self.sock.send_multipart([peer, req.transfer_id.encode(), LAYER.pack(layer), *views])

    def close(self):
        self.sock.close(0)


def _request(tid: str, mine, n: int) -> PullRequest:
    return PullRequest(transfer_id=tid, identity="me", layout=layout(mine), first_block=0, num_blocks=n)


def test_layer_i_is_usable_while_later_layers_still_travel():
    producer, mine = ScriptedProducer(), _caches(None)
    puller = KVPuller(mine)
    try:
        src, dst = [1, 2], [5, 6]
        pull = puller.start("k", producer.address, _request("t", mine, 2), dst, timeout_s=5)
        peer, req = producer.receive()
        producer.send_header(peer, req, src)
        producer.send_layer(peer, req, src, 0)
        puller.wait_layer(pull, 0)  # returns with layer 0 alone
        assert pull.layers_done == 1 and not pull.done
        assert torch.equal(mine[0][:, dst], producer.caches[0][:, src])
        assert not mine[1].any() and not mine[2].any()
        for layer in (1, 2):
            producer.send_layer(peer, req, src, layer)
        puller.wait_layer(pull, LAYERS - 1)
        assert pull.done and pull.error is None
        assert all(torch.equal(a[:, dst], b[:, src]) for a, b in zip(mine, producer.caches))
        assert [p.key for p in puller.take_done()] == ["k"]
    finally:
        puller.close()
        producer.close()


def test_a_stalled_transfer_fails_at_its_deadline_and_a_late_layer_is_never_written():
    producer, mine = ScriptedProducer(), _caches(None)
    puller = KVPuller(mine)
    try:
        pull = puller.start("k", producer.address, _request("t", mine, 1), [3], timeout_s=0.3)
        peer, req = producer.receive()
        producer.send_header(peer, req, [1])
        puller.wait_layer(pull, 0)
        assert pull.done and "did not complete within 0.3 s" in pull.error
        producer.send_layer(peer, req, [1], 0)  # too late: the blocks may belong to someone else by now
        threading.Event().wait(0.2)
        assert not any(c.any() for c in mine)
    finally:
        puller.close()
        producer.close()


def test_pulls_to_one_producer_share_one_socket():
    producer, mine = ScriptedProducer(), _caches(None)
    puller = KVPuller(mine)
    try:
        pulls = [puller.start(f"k{i}", producer.address, _request(f"t{i}", mine, 1), [i], timeout_s=5)
                 for i in range(2)]
        (peer_a, req_a), (peer_b, req_b) = producer.receive(), producer.receive()
        assert peer_a == peer_b  # one DEALER connection, the pulls told apart by their transfer ids
        for peer, req in ((peer_b, req_b), (peer_a, req_a)):  # answered out of order
            producer.send_header(peer, req, [4])
            for layer in range(LAYERS):
                producer.send_layer(peer, req, [4], layer)
        for p in pulls:
            puller.wait_layer(p, LAYERS - 1)
            assert p.done and p.error is None
    finally:
        puller.close()
        producer.close()


def test_a_second_pull_of_a_transfer_in_flight_fails_at_once_and_the_first_goes_on():
    producer, mine = ScriptedProducer(), _caches(None)
    puller = KVPuller(mine)
    try:
        first = puller.start("a", producer.address, _request("t", mine, 1), [0], timeout_s=5)
        peer, req = producer.receive()
        second = puller.start("b", producer.address, _request("t", mine, 1), [1], timeout_s=5)
        puller.wait_layer(second, 0)
        assert second.done and "already being pulled" in second.error
        producer.send_header(peer, req, [2])
        for layer in range(LAYERS):
            producer.send_layer(peer, req, [2], layer)
        puller.wait_layer(first, LAYERS - 1)
        assert first.done and first.error is None
    finally:
        puller.close()
        producer.close()
