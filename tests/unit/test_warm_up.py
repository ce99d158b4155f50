"""The warm-up phase: a short prefill and two decodes along the runner's own forward path, which time the
decode step for admission's first guess and leave the KV cache as they found it."""
from __future__ import annotations

import pytest
import torch

import tokenloom
from tokenloom.model.layers.attention_backend import ScheduledSpan
from tokenloom.worker.warm_up import PREFILL_TOKENS, step_forward, warm_up_runner


def _worker(core):
    return core.executor.worker


def test_the_warm_up_times_a_decode_step_for_admission(make_core):
    core = make_core("llama")
    seconds = _worker(core).setup.warmup_decode_seconds
    assert 0 < seconds < 5
    assert core.info.warmup_decode_seconds == seconds  # what the API process calibrates admission with


def test_the_warm_up_leaves_the_kv_cache_zeroed(make_core):
    runner = _worker(make_core("llama")).runner
    for cache in runner.kv_caches:
        cache[:, :2].fill_(1.0)  # as a previous warm-up's or request's keys would be
    warm_up_runner(runner, progress=False)
    assert all(not cache.any() for cache in runner.kv_caches)


def test_warming_up_again_gives_a_fresh_decode_time(make_core):
    """A wake-up after sleep runs the phase again: the estimate is measured anew, not kept."""
    runner = _worker(make_core("llama")).runner
    assert 0 < warm_up_runner(runner, progress=False) < 5


def _hidden(forward, runner, n: int) -> torch.Tensor:
    slots = torch.arange(n)
    meta = runner.attention.build_metadata([ScheduledSpan(0, 0, n, [0, 1])], slots)
    with torch.inference_mode():
        return forward(torch.arange(1, n + 1), slots, meta).clone()


def test_the_warm_up_runs_the_layer_by_layer_forward_of_an_eager_runner(make_core):
    runner = _worker(make_core("llama")).runner
    assert runner.forward.native_stack is None

    def eager(ids, positions, meta):
        return runner.model(ids, positions, runner.kv_caches, meta)

    torch.testing.assert_close(_hidden(step_forward(runner), runner, PREFILL_TOKENS),
                               _hidden(eager, runner, PREFILL_TOKENS), rtol=0, atol=0)


@pytest.mark.kernels
def test_the_warm_up_runs_the_native_stack_where_the_runner_has_one(make_llm):
    """The path every plain step of the embedded model takes: the warm-up's decode time is that path's."""
    runner = make_llm().engine.executor.worker.runner
    stack = runner.forward.native_stack
    assert tokenloom.kernels.enabled() and stack is not None

    def native(ids, positions, meta):
        return stack.run(ids, positions, runner.kv_caches, meta)

    torch.testing.assert_close(_hidden(step_forward(runner), runner, PREFILL_TOKENS),
                               _hidden(native, runner, PREFILL_TOKENS), rtol=0, atol=0)
