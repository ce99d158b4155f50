"""How many KV blocks a GPU rank can hold: a profiled peak, every byte counted once.

The rule (vLLM's, in spirit): after loading the weights, reset the allocator's peak statistics, run the
largest step the scheduler can emit, then

    budget = total * gpu_memory_utilization - in_use_after_profile - activation_peak

where `in_use_after_profile` is the device's used memory as the driver sees it once the profiling
temporaries are released (weights, the CUDA context, other processes: each counted once) and
`activation_peak` is how far the profiled step rose above what was allocated before it. The old rule
subtracted `max_memory_allocated` (which includes the weights) on top of the driver's used memory (which
also includes them), so a 7B model on a 24 GB card got almost no KV cache: `test_kv_budget.py` shows it.

The measuring is separate from the arithmetic so the arithmetic is unit-tested with plain figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tokenloom.config import ConfigError

GiB = 2 ** 30


@dataclass(frozen=True)
class ProfiledMemory:
    """Bytes, as measured around one profiling step on one device."""

    total: int  # the device's memory
    in_use_after: int  # used by anything (driver view) after the step's temporaries were released
    activation_peak: int  # the step's peak allocation above what was allocated before it


def kv_budget_bytes(memory: ProfiledMemory, utilization: float) -> int:
    """Bytes left for the KV cache; a clear error when the weights and activations already fill the share."""
    budget = int(memory.total * utilization) - memory.in_use_after - memory.activation_peak
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {memory.total / GiB:.1f} GiB is "
            f"{memory.total * utilization / GiB:.1f} GiB, but {memory.in_use_after / GiB:.1f} GiB is in use "
            f"(weights, CUDA context, other processes) and a step's activations peak at "
            f"{memory.activation_peak / GiB:.2f} GiB; raise --gpu-memory-utilization or lower "
            f"--max-num-batched-tokens")
    return budget


def kv_blocks(memory: ProfiledMemory, utilization: float, bytes_per_block: int) -> int:
    return max(kv_budget_bytes(memory, utilization) // bytes_per_block, 2)


def profile_cuda_step(run_step: Callable[[], None], device: torch.device) -> ProfiledMemory:
    """Run the largest step once and measure it (the caller has loaded the weights)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return ProfiledMemory(total=total, in_use_after=total - free, activation_peak=max(peak, 0))
