"""Start-up: the CPU KV cache reads as zeros but is not written page by page, so neither start-up time nor
the process's memory pays for the whole budget before requests use it; the attention backend choice."""
from __future__ import annotations

import pytest
import torch

from tokenloom import kernels
from tokenloom.config import ConfigError
from tokenloom.model.layers.attention_select import choose_attention_backend
from tokenloom.worker.kv_cache import allocate_kv_cache


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_a_cpu_kv_cache_reads_as_zeros_without_holding_its_size_in_memory():
    before = _rss_mib()
    cache = allocate_kv_cache((2, 4096, 16, 8, 64), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _rss_mib() - before < 32
    assert torch.count_nonzero(cache[:, 1000:1010]) == 0


def test_writing_a_block_takes_memory_for_that_block_only():
    cache = allocate_kv_cache((2, 4096, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    before = _rss_mib()
    cache[:, 7].fill_(1.0)
    assert _rss_mib() - before < 16
    assert cache[:, 7].eq(1).all() and cache[:, 8].eq(0).all()


def test_auto_picks_the_native_backend_for_float32_on_cpu_when_the_kernels_load():
    want = "native" if kernels.enabled() else "torch"
    assert choose_attention_backend("auto", torch.device("cpu"), torch.float32) == want
    assert choose_attention_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert choose_attention_backend("torch") == "torch"


def test_native_attention_with_bfloat16_activations_is_a_config_error():
    with pytest.raises(ConfigError, match="float32 activations on the CPU"):
        choose_attention_backend("native", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        choose_attention_backend("flash")


def test_the_start_up_line_states_the_cache_in_mib_and_per_token(make_core):
    core = make_core(num_blocks=2048, kv_cache_dtype="float32")
    try:
        summary = core.info.summary
    finally:
        core.shutdown()
    per_token = 2 * 2 * 4 * (64 // 4) * 4  # layers x (K, V) x KV heads x head_dim x bytes: 1 KiB
    assert per_token == 2**10 and 2048 * 16 * per_token == 32 * 2**20
    assert "2048 blocks of 16 tokens, 32 MiB (1.0 KiB a token)" in summary
