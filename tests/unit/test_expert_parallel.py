"""Expert parallelism on tiny random Qwen3-MoE and Qwen2-MoE models (8 experts, top-2): EP=2 against one process.

Every rank is a real worker process on gloo. With --enable-expert-parallel each rank holds 4 whole experts
(linear or round-robin placement) and the partial outputs are all-reduced; without it each rank holds a
slice of every expert. The summation order differs from one process, so logprobs agree within float
tolerance and greedy tokens are identical.
"""
from __future__ import annotations

import helpers
import pytest
import torch
from helpers import greedy_params, make_request

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.distributed import parallel_state
from tokenloom.distributed.expert_parallel import ExpertPlacement, init_expert_parallel
from tokenloom.engine.core import EngineCore
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.fused_moe import FusedMoE

pytestmark = pytest.mark.tp

PROMPTS = helpers.random_prompts(4, [5, 9, 23, 3], 512, seed=1)
LOGPROB_TOLERANCE = 1e-4  # float32, two partial sums instead of one
# layout -> (tiny model, TP=2 engine arguments); each is compared with the one-process engine on its model.
LAYOUTS = {"ep_linear": ("qwen3_moe", dict(enable_expert_parallel=True)),
           "ep_round_robin": ("qwen3_moe", dict(enable_expert_parallel=True, expert_placement_strategy="round_robin")),
           "tp_sliced_experts": ("qwen3_moe", dict()),
           "shared_expert_ep": ("qwen2_moe", dict(enable_expert_parallel=True))}


def _core(folder: str, **kwargs) -> EngineCore:
    args = dict(model=folder, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    return EngineCore(EngineConfig.from_kwargs(**{**args, **kwargs}), progress=False)


@pytest.fixture(scope="module")
def cores(tiny_models):
    """cores(layout): the TP=2 engine of a layout of LAYOUTS; cores(kind): the one-process engine on that model."""
    built = {}

    def get(key: str) -> EngineCore:
        if key not in built:
            kind, extra = LAYOUTS[key] if key in LAYOUTS else (key, None)
            extra = {} if extra is None else dict(tensor_parallel_size=2, **extra)
            built[key] = _core(tiny_models(kind)[0], **extra)
        return built[key]

    yield get
    for core in built.values():
        core.shutdown()


def _prompt_logprobs(core: EngineCore, prompt: list[int]) -> list[float]:
    core.add_request(make_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)))
    first = None
    while core.has_unfinished_requests():
        for out in core.step():
            first = first or out.prompt_logprobs
    return [entry[0][1] for entry in first[1:]]


# Each TP=2 engine starts two worker processes (10-30 s here): the default suite runs one layout, make soak all.
@pytest.mark.parametrize("layout", ["ep_round_robin", *(pytest.param(layout, marks=pytest.mark.slow) for layout in
                                                       ("ep_linear", "tp_sliced_experts", "shared_expert_ep"))])
def test_two_ranks_generate_the_greedy_tokens_of_one(cores, layout):
    params = greedy_params(12)
    one_process = cores(LAYOUTS[layout][0])
    assert helpers.generate_tokens(cores(layout), PROMPTS, params) == helpers.generate_tokens(one_process, PROMPTS,
                                                                                            params)


@pytest.mark.parametrize("layout", ["ep_round_robin", pytest.param("ep_linear", marks=pytest.mark.slow)])
def test_expert_parallel_prompt_logprobs_match_one_process_within_float_tolerance(cores, layout):
    for prompt in PROMPTS[:3]:
        one, two = _prompt_logprobs(cores(LAYOUTS[layout][0]), prompt), _prompt_logprobs(cores(layout), prompt)
        assert len(one) == len(two) == len(prompt) - 1
        assert max(abs(a - b) for a, b in zip(one, two)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("strategy, held", [("linear", [4, 5, 6, 7]), ("round_robin", [1, 3, 5, 7])])
def test_rank_one_of_two_loads_only_its_experts(strategy, held, monkeypatch):
    """The second rank's FusedMoE, built as the worker builds it, holds its four experts of a stacked tensor."""
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank=1, size=2))
    init_expert_parallel(True, strategy)
    try:
        experts = FusedMoE(num_experts=8, hidden_size=4, intermediate_size=2)
    finally:
        init_expert_parallel(False)
    assert experts.w13.shape == (4, 4, 4) and experts.w2.shape == (4, 4, 2)
    stacked = torch.arange(8.0).view(8, 1, 1).expand(8, 2, 4)  # every value of expert e is e
    experts.load("gate_proj.weight", stacked)
    assert experts.w13[:, 0, 0].tolist() == held
    assert experts.expert_map.tolist() == ExpertPlacement(8, 1, 2, strategy).expert_map().tolist()


def test_a_placement_without_expert_parallel_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="^expert_placement_strategy applies only with enable_expert_parallel"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, expert_placement_strategy="round_robin")


def test_an_unknown_placement_is_a_config_error():
    with pytest.raises(ConfigError, match="must be linear or round_robin"):
        EngineConfig.from_kwargs(enable_expert_parallel=True, expert_placement_strategy="random")


def test_expert_parallel_on_a_dense_model_is_a_config_error_before_any_worker_starts(tiny_models):
    with pytest.raises(ConfigError, match=r"^enable_expert_parallel needs a mixture-of-experts model "
                                          r"\(LlamaForCausalLM has no experts\)"):
        _core(tiny_models("llama")[0], tensor_parallel_size=2, enable_expert_parallel=True)


def test_experts_that_do_not_divide_over_the_ranks_are_a_config_error():
    arch = ArchConfig("Qwen3MoeForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1,
                      num_heads=6, num_kv_heads=6, head_dim=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48)
    with pytest.raises(ConfigError, match="^expert parallel over 3 ranks does not divide the model's 8 experts"):
        arch.check_tensor_parallel(3, expert_parallel=True)
    arch.check_tensor_parallel(3)  # without expert parallel the 48-wide experts are sliced in three


def test_the_vllm_flags_set_expert_parallel_and_its_placement():
    from tokenloom.entrypoints.cli import build_parser
    args = build_parser("serve").parse_args(["serve", "m", "-tp", "2", "--enable-expert-parallel",
                                            "--expert-placement-strategy", "round_robin"])
    parallel = EngineConfig.from_args(args).parallel
    assert (parallel.enable_expert_parallel, parallel.expert_placement_strategy) == (True, "round_robin")
    assert not EngineConfig.from_args(build_parser("serve").parse_args(["serve", "m"])).parallel.enable_expert_parallel
