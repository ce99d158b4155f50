"""The engine -> frontend messages decode straight into their structs: the engine info (pooling config
included), the per-step stats and the heartbeat's; a field of the wrong type (or, for the engine info, an
unknown one) fails to decode instead of reaching the server as a loose dict."""
from __future__ import annotations

import msgspec
import pytest

from tokenloom.core.engine_info import EngineInfo, KVCacheInfo
from tokenloom.core.pooling import PoolingConfig
from tokenloom.core.stats import EngineStats, engine_stats, sum_stats
from tokenloom.engine import ipc
from tokenloom.engine.core_proc import engine_info
from tokenloom.worker.worker_info import WorkerInfo


def _worker_info(**overrides) -> WorkerInfo:
    fields = dict(model_path="m", architecture="Bert", vocab_size=1000, max_position_embeddings=512,
                  eos_token_ids=[2], device="cpu", dtype="float32", kv_cache_dtype="bfloat16", num_blocks=64,
                  block_size=16, max_model_len=256, tensor_parallel_size=1, summary="one line",
                  warmup_decode_seconds=0.02)
    fields.update(overrides)
    return WorkerInfo(**fields)


class _Core:
    def __init__(self, info: WorkerInfo) -> None:
        self.info = info


def _roundtrip(msg: msgspec.Struct) -> ipc.EngineOutput:
    return ipc.decode_output(ipc.encode(msg))


def test_the_engine_info_arrives_typed_with_its_kv_cache_summary():
    info = engine_info(_Core(_worker_info()))
    got = _roundtrip(ipc.Ready(pid=7, info=info))
    assert isinstance(got, ipc.Ready) and isinstance(got.info, EngineInfo)
    assert got.info == info
    assert got.info.kv_cache == KVCacheInfo(num_blocks=64, block_size=16, dtype="bfloat16", full_length_requests=4)
    assert got.info.max_model_len == 256 and got.info.vocab_size == 1000 and got.info.pooling is None


@pytest.mark.parametrize("matryoshka", [False, True, (64, 128, 384)])
def test_the_pooling_config_arrives_as_its_struct(matryoshka):
    pooling = PoolingConfig("mean", True, 384, matryoshka)
    got = _roundtrip(ipc.Ready(pid=7, info=engine_info(_Core(_worker_info(pooling=pooling)))))
    assert isinstance(got.info.pooling, PoolingConfig)
    assert got.info.pooling == pooling
    assert got.info.pooling.matryoshka == matryoshka  # a tuple stays a tuple, a bool a bool
    allowed = got.info.pooling.check_dimensions(64) is None
    assert allowed == bool(matryoshka)


def _ready_map(**changes) -> dict:
    ready = msgspec.to_builtins(ipc.Ready(pid=7, info=engine_info(_Core(_worker_info()))))
    ready["info"].update(changes)
    return ready


def test_an_engine_info_with_a_wrong_field_fails_to_decode():
    for bad in ({"max_model_len": "long"}, {"kv_cache": {"num_blocks": 1}}, {"no_such_field": 1},
                {"pooling": {"method": "mean", "normalize": "yes", "dimensions": 8}}):
        with pytest.raises(msgspec.ValidationError):
            ipc.decode_output(msgspec.msgpack.encode(_ready_map(**bad)))


def test_step_stats_and_heartbeat_stats_decode_into_engine_stats():
    stats = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.5, spec_num_drafts=4,
                        spec_num_accepted_tokens_per_pos=[3, 1])
    step = _roundtrip(ipc.StepOutputs(outputs=[], timestamp=1.0, stats=stats, num_step_tokens=5))
    assert isinstance(step, ipc.StepOutputs) and step.stats == stats
    beat = _roundtrip(ipc.Heartbeat(timestamp=1.0, stats=stats))
    assert isinstance(beat, ipc.Heartbeat) and beat.stats == stats
    during_a_step = _roundtrip(ipc.Heartbeat(timestamp=1.0, step_elapsed=2.5))
    assert during_a_step.stats is None
    result = _roundtrip(ipc.UtilityResult(call_id=1, result=stats))
    assert isinstance(result.result, EngineStats) and result.result == stats


def test_stats_with_a_wrong_type_fail_to_decode():
    beat = msgspec.to_builtins(ipc.Heartbeat(timestamp=1.0, stats=EngineStats()))
    beat["stats"]["num_running"] = "three"
    with pytest.raises(msgspec.ValidationError):
        ipc.decode_output(msgspec.msgpack.encode(beat))
    with pytest.raises(msgspec.ValidationError):
        engine_stats({"kv_cache_usage": [0.5]})


def test_engine_core_stats_become_the_struct():
    """EngineCore.stats() is a dict (the offline LLM reads it); the engine process converts it before sending."""
    stats = engine_stats({"num_running": 2, "kv_cache_usage": 0.25, "prefix_cache_hits": 8, "steps": 3,
                          "kv_offload_saved": 5})
    assert stats.num_running == 2 and stats.kv_cache_usage == 0.25 and stats.kv_offload_saved == 5
    assert stats.spec_num_drafts is None  # no drafter: the speculation fields stay unset


def test_replica_stats_sum_and_average_the_kv_usage():
    total = sum_stats([EngineStats(num_running=1, kv_cache_usage=0.2, spec_num_drafts=2),
                       EngineStats(num_running=2, kv_cache_usage=0.6)])
    assert total.num_running == 3 and total.kv_cache_usage == pytest.approx(0.4) and total.spec_num_drafts == 2
