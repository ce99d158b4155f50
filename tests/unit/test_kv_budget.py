"""GPU KV-cache sizing from a profiled peak: the arithmetic, with the device's figures given as numbers."""
import pytest

from tokenloom.config import ConfigError
from tokenloom.worker.kv_budget import GiB, ProfiledMemory, kv_blocks, kv_budget_bytes

# A 7B model in bf16 (14 GiB of weights) on a 24 GiB card, with a 0.5 GiB CUDA context and a 1.5 GiB step peak.
SEVEN_B_ON_24GB = ProfiledMemory(total=24 * GiB, in_use_after=int(14.5 * GiB), activation_peak=int(1.5 * GiB))


def test_weights_are_counted_once():
    # 0.9 * 24 = 21.6 GiB; minus 14.5 GiB in use and 1.5 GiB of activations leaves 5.6 GiB.
    assert kv_budget_bytes(SEVEN_B_ON_24GB, 0.9) == pytest.approx(5.6 * GiB, rel=1e-9)


def test_the_old_rule_left_a_7b_model_almost_nothing():
    """The replaced rule subtracted max_memory_allocated (weights + activations) on top of the driver's used
    memory (weights again): 21.6 - 14.5 - 15.5 < 0, floored to two blocks."""
    peak_including_weights = 14 * GiB + SEVEN_B_ON_24GB.activation_peak
    old = 0.9 * SEVEN_B_ON_24GB.total - SEVEN_B_ON_24GB.in_use_after - peak_including_weights
    assert old < 0 < kv_budget_bytes(SEVEN_B_ON_24GB, 0.9)


def test_blocks_are_whole_budget_divided_by_block_bytes():
    # Llama-2-7B: 32 layers x 16 tokens x 32 KV heads x 128 x 2 (K, V) x 2 bytes = 8 MiB a block.
    per_block = 2 * 32 * 16 * 32 * 128 * 2
    assert kv_blocks(SEVEN_B_ON_24GB, 0.9, per_block) == int(5.6 * GiB) // per_block == 716


def test_other_processes_memory_reduces_the_budget():
    shared = ProfiledMemory(total=80 * GiB, in_use_after=40 * GiB, activation_peak=2 * GiB)
    alone = ProfiledMemory(total=80 * GiB, in_use_after=16 * GiB, activation_peak=2 * GiB)
    assert kv_budget_bytes(alone, 0.9) - kv_budget_bytes(shared, 0.9) == 24 * GiB


def test_lower_utilization_gives_a_smaller_budget():
    assert kv_budget_bytes(SEVEN_B_ON_24GB, 0.8) == pytest.approx(kv_budget_bytes(SEVEN_B_ON_24GB, 0.9) - 2.4 * GiB)


def test_a_full_device_is_a_clear_error():
    full = ProfiledMemory(total=24 * GiB, in_use_after=22 * GiB, activation_peak=1 * GiB)
    with pytest.raises(ConfigError, match="no GPU memory left for the KV cache.*--gpu-memory-utilization"):
        kv_budget_bytes(full, 0.9)
