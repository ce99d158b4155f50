"""The KV transport alone (real ZMQ sockets over TCP and IPC, real tensors) and the configuration of KV
transfer and offload: what is accepted, and the one-line errors for what is not."""
from __future__ import annotations

import argparse

import pytest
import torch
import zmq

from tokenloom.config import ConfigError, EngineConfig, add_engine_args
from tokenloom.kv_transfer.blocks import block_runs, layout
from tokenloom.kv_transfer.puller import pull
from tokenloom.kv_transfer.transport import MAX_REQUEST_BYTES, KVServer, PullRequest

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 12, 4, 2, 8


def caches(seed: int | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=g) if g else torch.zeros(2, BLOCKS, BS, HEADS, DIM)
            for _ in range(LAYERS)]


def request(tid: str, kv, num_blocks: int, first_block: int = 0, identity: str = "me") -> PullRequest:
    return PullRequest(transfer_id=tid, identity=identity, layout=layout(kv), first_block=first_block,
                       num_blocks=num_blocks)


@pytest.fixture(params=["tcp", "ipc"])
def server(request):
    srv = KVServer(caches(0), "me", "127.0.0.1", 0, request.param)
    yield srv
    srv.close()


def test_consecutive_block_ids_travel_as_runs():
    assert block_runs([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]


def test_a_pull_copies_the_published_blocks_into_other_block_ids(server):
    src = [1, 2, 3, 7, 0]
    server.publish("t", src, lease_s=10)
    mine = caches(None)
    dst = [11, 4, 5, 6, 9]
    assert pull(server.address, request("t", mine, len(src)), mine, dst, timeout_s=5) is None
    for a, b in zip(mine, server.kv_caches):
        assert torch.equal(a[:, dst], b[:, src])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert all(not c[:, untouched].any() for c in mine)


def test_a_pull_can_skip_the_blocks_already_cached_here(server):
    server.publish("t", [1, 2, 3], lease_s=10)
    mine = caches(None)
    assert pull(server.address, request("t", mine, 2, first_block=1), mine, [8, 9], timeout_s=5) is None
    assert torch.equal(mine[0][:, [8, 9]], server.kv_caches[0][:, [2, 3]])


def test_a_transfer_is_served_once_and_reported_sent(server):
    server.publish("t", [1], lease_s=10)
    mine = caches(None)
    assert pull(server.address, request("t", mine, 1), mine, [0], timeout_s=5) is None
    assert server.take_sent() == ["t"]
    assert "unknown or expired" in pull(server.address, request("t", mine, 1), mine, [0], timeout_s=5)


def test_a_released_transfer_is_not_served(server):
    server.publish("t", [1], lease_s=10)
    server.release(["t"])
    mine = caches(None)
    assert "unknown or expired" in pull(server.address, request("t", mine, 1), mine, [0], timeout_s=5)


def test_another_models_pull_is_refused(server):
    server.publish("t", [1], lease_s=10)
    mine = caches(None)
    assert "differs" in pull(server.address, request("t", mine, 1, identity="other"), mine, [0], timeout_s=5)


def test_a_pull_for_a_different_block_count_is_refused(server):
    server.publish("t", [1, 2], lease_s=10)
    mine = caches(None)
    assert "the transfer has 2" in pull(server.address, request("t", mine, 3), mine, [0, 1, 2], timeout_s=5)


def test_an_oversized_request_is_dropped_and_the_server_keeps_serving(server):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    sock.send(b"x" * (MAX_REQUEST_BYTES + 1))
    assert not sock.poll(300)
    sock.close(0)
    server.publish("t", [1], lease_s=10)
    mine = caches(None)
    assert pull(server.address, request("t", mine, 1), mine, [0], timeout_s=5) is None


def test_nothing_listening_fails_within_the_timeout():
    mine = caches(None)
    error = pull("tcp://127.0.0.1:9", request("t", mine, 1), mine, [0], timeout_s=0.3)
    assert "within 0.3 s" in error


# ---- configuration -------------------------------------------------------------------------------
def test_splitwise_roles_map_to_kv_roles():
    assert EngineConfig.from_kwargs(splitwise_role="prefill").kv_transfer_config.kv_role == "kv_producer"
    assert EngineConfig.from_kwargs(splitwise_role="decode").kv_transfer_config.kv_role == "kv_consumer"
    assert EngineConfig.from_kwargs(splitwise_role="mixed").kv_transfer_config is None


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_transfer_config": '{"kv_role": "producer"}'}, "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    ({"kv_transfer_config": '{"kv_rol": "kv_producer"}'}, "unknown kv_transfer_config key(s): kv_rol"),
    ({"kv_transfer_config": "{nope"}, "--kv-transfer-config is not valid JSON"),
    ({"kv_transfer_config": {"kv_load_failure_policy": "retry"}}, "kv_load_failure_policy must be one of"),
    ({"splitwise_role": "both"}, "splitwise_role must be one of prefill, decode, mixed"),
    ({"splitwise_role": "prefill", "kv_transfer_config": {"kv_role": "kv_consumer"}}, "contradicts kv_role"),
    ({"splitwise_role": "prefill", "kv_offloading_backend": "native"}, "cannot be combined"),
    ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend must be one of native"),
    ({"kv_offloading_backend": "native", "kv_offloading_size": 0}, "kv_offloading_size must be > 0 GiB"),
    ({"kv_offloading_backend": "native", "enable_prefix_caching": False}, "needs prefix caching"),
])
def test_a_bad_setting_is_a_one_line_config_error(kwargs, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-transfer-config", '{"kv_role": "kv_both", "kv_transport": "ipc"}'])
    cfg = EngineConfig.from_args(ns).kv_transfer_config
    assert (cfg.kv_role, cfg.kv_transport) == ("kv_both", "ipc")
    ns = parser.parse_args(["--kv-offloading-backend", "native", "--kv-offloading-size", "0.5",
                            "--kv-offloading-path", "/tmp/kv"])
    off = EngineConfig.from_args(ns).kv_offload_config
    assert (off.backend, off.size_gib, off.path) == ("native", 0.5, "/tmp/kv")


def test_the_prefill_request_asks_for_one_token_unstreamed_and_remote_decode():
    from tokenloom.router.pd import prefill_body
    body = {"prompt": "x", "max_tokens": 50, "min_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "min_tokens": 1, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50  # the decoder gets the original


def test_connector_instructions_and_reports_cross_the_worker_process_boundary():
    from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
    from tokenloom.core.kv_metadata import (
        BlockLoad,
        BlockSave,
        KVConnectorMetadata,
        KVConnectorOutput,
        Publish,
        RemoteLoad,
    )
    from tokenloom.worker import messages
    meta = KVConnectorMetadata(remote_loads=[RemoteLoad("k", ["tcp://127.0.0.1:5"], "t", 1, [4, 5], False)],
                               publish=[Publish("k2", "t2", 37)], release=["t3"], poll=True,
                               saves=[BlockSave(3, "n1")], drops=["n2"], loads=[BlockLoad("k", 9, "n3")])
    step = SchedulerOutput(step_id=3, kv_connector=meta)
    assert step  # a step with connector work runs even without tokens
    assert messages.decode_input(messages.encode(messages.ExecuteModel(step))).step.kv_connector == meta
    report = KVConnectorOutput(sent=["t"], loaded=["k3"], failed={"k": "x"})
    done = messages.StepDone(output=ModelRunnerOutput(kv_connector=report))
    assert messages.decode_output(messages.encode(done)).output.kv_connector == report
