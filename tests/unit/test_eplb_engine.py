"""The expert load balancer in the engine: the tiny random Qwen3-MoE (8 experts, top-2) on two expert-parallel
worker processes (gloo), re-placing its experts every two steps of a generation, with two redundant copies.

The prompts repeat a few tokens, so the router sends most pairs to a few experts (skewed load); the
balancer's placements change mid-generation and the weights move between the processes, and the greedy tokens
stay those of the same engine without the balancer and of one process.
"""
from __future__ import annotations

import helpers
import pytest
from helpers import greedy_params

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.engine.core import EngineCore

pytestmark = pytest.mark.tp

SKEWED_PROMPTS = [[7] * 12, [7] * 5 + [9] * 4, [9, 7] * 6, [7] * 3, [9] * 20]
EPLB = dict(enable_eplb=True, eplb_config={"window_size": 4, "step_interval": 2, "num_redundant_experts": 2})
MAX_TOKENS = 16


def _core(folder: str, **kwargs) -> EngineCore:
    args = dict(model=folder, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    return EngineCore(EngineConfig.from_kwargs(**{**args, **kwargs}), progress=False)


@pytest.fixture(scope="module")
def runs(tiny_models):
    """(tokens, engine stats) of the skewed prompts: one process, EP=2, EP=2 with the load balancer."""
    folder = tiny_models("qwen3_moe")[0]
    out = {}
    for name, extra in (("one_process", {}), ("ep", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
                        ("ep_eplb", dict(tensor_parallel_size=2, enable_expert_parallel=True, **EPLB))):
        core = _core(folder, **extra)
        try:
            out[name] = helpers.generate_tokens(core, SKEWED_PROMPTS, greedy_params(MAX_TOKENS)), core.stats()
        finally:
            core.shutdown()
    return out


def test_the_experts_are_re_placed_several_times_mid_generation(runs):
    stats = runs["ep_eplb"][1]
    assert stats["eplb_rebalances"] == stats["steps"] // 2 >= 5
    assert stats["eplb_experts_moved"] > 0


def test_greedy_output_with_the_load_balancer_is_token_identical_to_without_it_and_to_one_process(runs):
    tokens = runs["ep_eplb"][0]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == runs["ep"][0] == runs["one_process"][0]


def test_the_engine_without_the_balancer_reports_no_expert_load(runs):
    assert "eplb_rebalances" not in runs["ep"][1]


def test_redundant_experts_that_do_not_fit_are_a_config_error_before_any_worker_starts(tiny_models):
    with pytest.raises(ConfigError, match="^num_redundant_experts 1 does not divide over 2 expert-parallel ranks"):
        _core(tiny_models("qwen3_moe")[0], tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=1)


def test_the_load_balancer_on_a_dense_model_is_a_config_error_before_any_worker_starts(tiny_models):
    with pytest.raises(ConfigError, match=r"^enable_expert_parallel needs a mixture-of-experts model "
                                          r"\(LlamaForCausalLM has no experts\)"):
        _core(tiny_models("llama")[0], tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)


# Qwen2-MoE's shared expert and Mixtral's routing, round-robin start, four redundant experts (make soak).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_other_families_under_the_load_balancer_generate_the_greedy_tokens_of_one_process(tiny_models, kind):
    folder = tiny_models(kind)[0]
    built = []
    try:
        one = _core(folder)
        built.append(one)
        balanced = _core(folder, tensor_parallel_size=2, enable_expert_parallel=True,
                         expert_placement_strategy="round_robin", enable_eplb=True,
                         eplb_config={"window_size": 4, "step_interval": 2, "num_redundant_experts": 4})
        built.append(balanced)
        params = greedy_params(MAX_TOKENS)
        assert helpers.generate_tokens(balanced, SKEWED_PROMPTS, params) == helpers.generate_tokens(
            one, SKEWED_PROMPTS, params)
        assert balanced.stats()["eplb_experts_moved"] > 0
    finally:
        for core in built:
            core.shutdown()
