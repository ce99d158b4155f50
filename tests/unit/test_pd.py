"""Prefill/decode disaggregation on two real EngineCores over a tiny random Llama, the KV moving over ZMQ:
a 1P1D pair answers token for token as one mixed instance, the decoder computes no prompt token, the blocks
it receives are the producer's, and every failure (producer gone, producer silent, lease over) ends in the
configured policy, never a hang."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from helpers import greedy_params, make_request, random_prompts

PROMPTS = random_prompts(3, [37, 16, 5], 512, seed=3)
MAX_TOKENS = 10


def drive(core, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; every output per request id."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return outs
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prefill(producer, rid: str, prompt: list[int]) -> dict:
    """Run the prompt on the producer as the PD proxy does; returns the params for the decoder."""
    producer.add_request(make_request(rid, prompt, greedy_params(1, kv_transfer_params={"do_remote_decode": True})))
    final = drive(producer)[rid][-1]
    assert final.finish_reason == "length" and final.kv_transfer_params, final
    return final.kv_transfer_params


def decode(consumer, rid: str, prompt: list[int], params: dict, max_tokens: int = MAX_TOKENS):
    consumer.add_request(make_request(rid, prompt, greedy_params(max_tokens, kv_transfer_params=params)))
    return drive(consumer)[rid]


@pytest.fixture(scope="module")
def mixed_outputs(make_core):
    core = make_core("llama")
    out = {}
    for i, p in enumerate(PROMPTS):
        core.add_request(make_request(f"m{i}", p, greedy_params(MAX_TOKENS)))
    for rid, outs in drive(core).items():
        out[rid] = tokens(outs)
    return [out[f"m{i}"] for i in range(len(PROMPTS))]


@pytest.fixture
def producer(make_core):
    core = make_core("llama", kv_transfer_config={"kv_role": "kv_producer"})
    yield core
    core.shutdown()


@pytest.fixture
def consumer(make_core):
    core = make_core("llama", splitwise_role="decode")
    yield core
    core.shutdown()


def _worker(core):
    return core.executor.worker


def test_1p1d_greedy_output_is_token_identical_to_one_mixed_instance(producer, consumer, mixed_outputs):
    for i, prompt in enumerate(PROMPTS):
        params = prefill(producer, f"p{i}", prompt)
        assert tokens(decode(consumer, f"d{i}", prompt, params)) == mixed_outputs[i]


def test_the_decoder_computes_no_prompt_token(producer, consumer):
    prompt = PROMPTS[0]
    params = prefill(producer, "p", prompt)
    outs = decode(consumer, "d", prompt, params)
    assert outs[-1].num_cached_tokens == len(prompt)
    # The first token came from the producer; each later one cost one computed token (the previous one's KV).
    assert consumer.counters["batched_tokens"] == MAX_TOKENS - 1


def test_the_transferred_blocks_equal_the_producers(producer, consumer):
    prompt = PROMPTS[0]
    params = prefill(producer, "p", prompt)
    lease = producer.kv_connector.leases[params["remote_transfer_id"]]
    consumer.add_request(make_request("d", prompt, greedy_params(MAX_TOKENS, kv_transfer_params=params)))
    consumer.step()  # the pull, then the first token's KV
    received = consumer.scheduler.requests["d"].block_ids
    n = len(prompt)
    for mine, theirs in zip(_worker(consumer).runner.kv_caches, _worker(producer).runner.kv_caches):
        want = theirs[:, lease.block_ids].flatten(1, 2)[:, :n]
        got = mine[:, received[:len(lease.block_ids)]].flatten(1, 2)[:, :n]
        assert torch.equal(got, want)


def test_the_producer_frees_its_blocks_once_the_decoder_has_pulled_them(producer, consumer):
    params = prefill(producer, "p", PROMPTS[0])
    assert producer.kv_manager.pool.num_used > 0  # held under the lease
    decode(consumer, "d", PROMPTS[0], params)
    producer.step()  # hears that the transfer was sent
    assert producer.kv_manager.pool.num_used == 0
    assert producer.stats()["kv_transfer_sent"] == 1


def test_a_lease_frees_the_producers_blocks_when_the_decoder_never_comes(make_core):
    producer = make_core("llama", kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 0.2})
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                                                      "kv_transfer_timeout_s": 2})
    try:
        params = prefill(producer, "p", PROMPTS[0])
        assert producer.kv_manager.pool.num_used > 0
        time.sleep(0.3)
        producer.step()
        assert producer.kv_manager.pool.num_used == 0
        assert producer.stats()["kv_transfer_expired"] == 1
        final = decode(consumer, "d", PROMPTS[0], params)[-1]  # too late: the blocks may hold anything now
        assert final.finish_reason == "error" and "expired" in final.error
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_producer_gone_before_the_pull_recomputes_under_the_recompute_policy(make_core, producer, mixed_outputs):
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 1,
                                                      "kv_load_failure_policy": "recompute"})
    try:
        params = prefill(producer, "p", PROMPTS[0])
        _worker(producer).kv_hook.connector.close()  # the producer's KV server dies
        outs = decode(consumer, "d", PROMPTS[0], params)
        assert tokens(outs) == mixed_outputs[0]
        assert consumer.counters["batched_tokens"] > len(PROMPTS[0])  # it computed the prompt itself
    finally:
        consumer.shutdown()


def test_a_producer_gone_before_the_pull_fails_the_request_under_the_fail_policy(make_core, producer):
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 1,
                                                      "kv_load_failure_policy": "fail"})
    try:
        params = prefill(producer, "p", PROMPTS[0])
        _worker(producer).kv_hook.connector.close()
        outs = decode(consumer, "d", PROMPTS[0], params)
        assert outs[-1].finish_reason == "error" and "KV transfer failed" in outs[-1].error
        assert consumer.kv_manager.pool.num_used == 0
    finally:
        consumer.shutdown()


def test_a_transfer_that_times_out_ends_the_request_with_an_error_not_a_hang(make_core):
    """The producer accepted the pull and went silent (a hung or killed process mid-transfer)."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 0.5,
                                                      "kv_load_failure_policy": "fail"})
    try:
        params = {"do_remote_prefill": True, "remote_address": f"tcp://127.0.0.1:{port}",
                  "remote_transfer_id": "0" * 32, "remote_num_tokens": len(PROMPTS[1]), "first_token_id": 7}
        start = time.monotonic()
        outs = decode(consumer, "d", PROMPTS[1], params)
        assert time.monotonic() - start < 5
        assert outs[0].new_token_ids == [7]  # the producer's first token, then the error
        assert outs[-1].finish_reason == "error" and "within 0.5 s" in outs[-1].error
    finally:
        consumer.shutdown()
        silent.close(0)


def test_a_decoder_of_another_model_is_refused_the_blocks(make_core, producer):
    other = make_core("qwen2", kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"})
    try:
        params = prefill(producer, "p", PROMPTS[1])
        final = decode(other, "d", PROMPTS[1], params)[-1]
        assert final.finish_reason == "error" and "differs" in final.error
    finally:
        other.shutdown()


def test_remote_prefill_params_that_do_not_match_the_prompt_are_rejected(consumer):
    params = {"do_remote_prefill": True, "remote_address": "tcp://127.0.0.1:1", "remote_transfer_id": "x",
              "remote_num_tokens": 99, "first_token_id": 7}
    with pytest.raises(ValueError, match="do not match this prompt"):
        consumer.add_request(make_request("d", PROMPTS[1], greedy_params(4, kv_transfer_params=params)))


def test_a_decoder_with_a_producer_list_refuses_an_address_off_it(make_core):
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_producers": ["10.0.0.5"]})
    params = {"do_remote_prefill": True, "remote_address": "tcp://127.0.0.1:1", "remote_transfer_id": "x",
              "remote_num_tokens": len(PROMPTS[1]), "first_token_id": 7}
    with pytest.raises(ValueError, match="not among kv_producers"):
        consumer.add_request(make_request("d", PROMPTS[1], greedy_params(4, kv_transfer_params=params)))


def test_a_decoder_pulls_from_a_producer_on_its_list(make_core, producer, mixed_outputs):
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_producers": ["127.0.0.1"]})
    params = prefill(producer, "p", PROMPTS[0])
    assert tokens(decode(consumer, "d", PROMPTS[0], params)) == mixed_outputs[0]


def test_a_prefill_only_instance_refuses_remote_prefill_params(producer):
    params = {"do_remote_prefill": True}
    with pytest.raises(ValueError, match="not a KV consumer"):
        producer.add_request(make_request("d", PROMPTS[1], greedy_params(4, kv_transfer_params=params)))


def test_a_decoder_pulls_only_what_its_own_prefix_cache_lacks(producer, consumer, mixed_outputs):
    prompt = PROMPTS[0]  # 37 tokens: blocks of 16, 16 and 5
    consumer.add_request(make_request("warm", prompt[:33], greedy_params(1)))
    drive(consumer)  # the decoder now caches the first two blocks
    hits_before = consumer.stats()["prefix_cache_hits"]
    params = prefill(producer, "p", prompt)
    outs = decode(consumer, "d", prompt, params)
    assert tokens(outs) == mixed_outputs[0]
    assert consumer.stats()["prefix_cache_hits"] - hits_before == 32
    assert outs[-1].num_cached_tokens == len(prompt)


@pytest.mark.slow
def test_1p1d_with_each_worker_in_its_own_process(make_core, mixed_outputs):
    """The connector's instructions and reports cross the executor's process boundary (mp executor)."""
    producer = make_core("llama", splitwise_role="prefill", distributed_executor_backend="mp")
    consumer = make_core("llama", splitwise_role="decode", distributed_executor_backend="mp")
    try:
        params = prefill(producer, "p", PROMPTS[0])
        outs = decode(consumer, "d", PROMPTS[0], params)
        assert tokens(outs) == mixed_outputs[0] and outs[-1].num_cached_tokens == len(PROMPTS[0])
        producer.step()
        assert producer.kv_manager.pool.num_used == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_first_token_that_ends_the_request_needs_no_transfer(consumer):
    from tokenloom.core.sampling_params import SamplingParams
    params = {"do_remote_prefill": True, "remote_address": "tcp://127.0.0.1:9", "remote_transfer_id": "t",
              "remote_num_tokens": len(PROMPTS[2]), "first_token_id": 2}  # 2: the model's end of sequence
    consumer.add_request(make_request("d", PROMPTS[2], SamplingParams(temperature=0, max_tokens=8,
                                                                      kv_transfer_params=params)))
    outs = drive(consumer)["d"]
    assert [o.new_token_ids for o in outs] == [[2]] and outs[0].finish_reason == "stop"
    assert consumer.counters["steps"] == 0


class HeldProducer:
    """A producer that answers only when the test lets it: pulls reach the real producer once `release` is
    called (a busy or distant prefill instance); its answers come back unchanged."""

    def __init__(self, target: str):
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.back = ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(target)
        self.released = threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def release(self) -> None:
        self.released.set()

    def _relay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        held, peer = [], None
        while not self.stop:
            for sock, _ in poller.poll(10):
                if sock is self.front:
                    peer, body = self.front.recv_multipart()
                    held.append(body)
                else:
                    self.front.send_multipart([peer, *self.back.recv_multipart()])
            while held and self.released.is_set():
                self.back.send(held.pop(0))
        self.front.close(0)
        self.back.close(0)

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)


def test_a_slow_pull_does_not_stop_the_other_requests_decoding(producer, consumer, mixed_outputs):
    params = prefill(producer, "p", PROMPTS[0])
    held = HeldProducer(params["remote_address"])
    try:
        consumer.add_request(make_request("other", PROMPTS[1], greedy_params(20)))
        consumer.step()  # "other" is running
        params = dict(params, remote_address=held.address)
        consumer.add_request(make_request("d", PROMPTS[0], greedy_params(MAX_TOKENS, kv_transfer_params=params)))
        outs: dict[str, list] = {}
        while "other" not in outs or not outs["other"][-1].finish_reason:
            for o in consumer.step():
                outs.setdefault(o.request_id, []).append(o)
            assert [k for k in consumer.scheduler.loading] and len(outs.get("d", [])) <= 1  # still held
        assert len(tokens(outs["other"])) == 20 - 1  # "other" decoded to its end while the pull was held
        held.release()
        for rid, more in drive(consumer).items():
            outs.setdefault(rid, []).extend(more)
        assert tokens(outs["d"]) == mixed_outputs[0]
        assert outs["d"][-1].num_cached_tokens == len(PROMPTS[0])  # its prompt still came from the producer
        assert consumer.kv_manager.pool.num_used == 0
    finally:
        held.close()


def test_with_nothing_else_running_the_pull_runs_inside_the_requests_own_step(producer, consumer, mixed_outputs):
    params = prefill(producer, "p", PROMPTS[0])
    consumer.add_request(make_request("d", PROMPTS[0], greedy_params(MAX_TOKENS, kv_transfer_params=params)))
    first = [t for o in consumer.step() for t in o.new_token_ids]
    assert not consumer.scheduler.loading
    assert first == mixed_outputs[0][:2]  # the producer's token, then the one computed on the pulled KV


def test_an_aborted_requests_blocks_wait_for_its_background_pull_to_end(producer, consumer):
    params = prefill(producer, "p", PROMPTS[0])
    held = HeldProducer(params["remote_address"])
    try:
        consumer.add_request(make_request("other", PROMPTS[1], greedy_params(4)))
        consumer.step()
        consumer.add_request(make_request("d", PROMPTS[0], greedy_params(MAX_TOKENS, kv_transfer_params=dict(
            params, remote_address=held.address))))
        consumer.step()  # d's pull starts in the background
        consumer.abort_requests(["d"])
        drive(consumer)  # "other" ends; d's blocks stay held: the puller may still write into them
        assert consumer.kv_manager.pool.num_used == -(-len(PROMPTS[0]) // 16)
        held.release()
        for _ in range(500):
            consumer.step()  # polls until the pull has ended
            if consumer.kv_manager.pool.num_used == 0:
                break
        assert consumer.kv_manager.pool.num_used == 0
    finally:
        held.close()


def test_a_background_pull_that_times_out_ends_its_request_with_an_error_and_spares_the_others(make_core):
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 0.5,
                                                      "kv_load_failure_policy": "fail"})
    try:
        consumer.add_request(make_request("other", PROMPTS[1], greedy_params(8)))
        consumer.step()
        params = {"do_remote_prefill": True, "remote_address": f"tcp://127.0.0.1:{port}",
                  "remote_transfer_id": "0" * 32, "remote_num_tokens": len(PROMPTS[2]), "first_token_id": 7}
        consumer.add_request(make_request("d", PROMPTS[2], greedy_params(MAX_TOKENS, kv_transfer_params=params)))
        outs = drive(consumer)
        assert outs["d"][-1].finish_reason == "error" and "within 0.5 s" in outs["d"][-1].error
        assert outs["other"][-1].finish_reason == "length" and len(tokens(outs["other"])) == 8 - 1
        assert consumer.kv_manager.pool.num_used == 0
    finally:
        consumer.shutdown()
        silent.close(0)
