"""Prefill/decode disaggregation and the offload tier at tensor parallel size 2: each rank moves its own shard
of the KV heads (producer rank r serves, decoder rank r pulls from it), and a pair whose TP sizes differ is
refused with a clear error. Real worker processes on gloo, a tiny random Llama (4 heads, 2 KV heads)."""
from __future__ import annotations

import os

import pytest
from helpers import greedy_params, make_request, random_prompts
from test_pd import decode, drive, prefill, tokens

pytestmark = [pytest.mark.tp, pytest.mark.slow]  # three TP=2 engines (six worker processes): ~70 s on 2 cores

PROMPTS = random_prompts(2, [37, 9], 512, seed=5)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tp2(make_core):
    """(producer, consumer, mixed) at TP=2 for the module."""
    made = [make_core("llama", tensor_parallel_size=2, splitwise_role=role) for role in ("prefill", "decode", "mixed")]
    yield made
    for core in made:
        core.shutdown()


def test_1p1d_at_tp2_answers_token_for_token_as_one_mixed_tp2_instance(tp2):
    producer, consumer, mixed = tp2
    assert len(producer.info.kv_connector.addresses) == 2  # one endpoint per rank
    for i, prompt in enumerate(PROMPTS):
        mixed.add_request(make_request(f"m{i}", prompt, greedy_params(MAX_TOKENS)))
        expected = tokens(drive(mixed)[f"m{i}"])
        params = prefill(producer, f"p{i}", prompt)
        assert isinstance(params["remote_address"], list) and len(params["remote_address"]) == 2
        outs = decode(consumer, f"d{i}", prompt, params, MAX_TOKENS)
        assert tokens(outs) == expected
        assert outs[-1].num_cached_tokens == len(prompt)  # the decoder computed no prompt token
    producer.step()  # hears that every rank's shard was sent
    assert producer.kv_manager.pool.num_used == 0


def test_a_tp1_decoder_is_refused_a_tp2_producers_blocks(tp2, make_core):
    producer = tp2[0]
    consumer = make_core("llama", kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"})
    try:
        params = prefill(producer, "p", PROMPTS[1])
        final = decode(consumer, "d", PROMPTS[1], params, MAX_TOKENS)[-1]
        assert final.finish_reason == "error" and "tensor-parallel mismatch" in final.error
    finally:
        consumer.shutdown()


def test_the_offload_tier_at_tp2_keeps_one_shard_per_rank_across_a_restart(make_core, tmp_path):
    args = dict(tensor_parallel_size=2, kv_offloading_backend="native", kv_offloading_path=str(tmp_path))
    first = make_core("llama", **args)
    try:
        first.add_request(make_request("a", PROMPTS[0], greedy_params(MAX_TOKENS)))
        expected = tokens(drive(first)["a"])
    finally:
        first.shutdown()  # saves the cached blocks, each rank its shard under its own folder
    folders = [d for d in os.listdir(tmp_path)]
    assert len(folders) == 2 and all(os.listdir(tmp_path / d) for d in folders)
    second = make_core("llama", **args)
    try:
        second.add_request(make_request("b", PROMPTS[0], greedy_params(MAX_TOKENS)))
        outs = drive(second)["b"]
        assert tokens(outs) == expected
        assert outs[-1].num_cached_tokens > 0
    finally:
        second.shutdown()
