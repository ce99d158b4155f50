"""The expert load balancer's parts, each alone: the placement algorithm (tokenloom.distributed.eplb), the moves
between placements, the routing over copies, the starting slots, and its configuration.

The engine running it on two ranks mid-generation is tests/unit/test_eplb_engine.py.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.stats import EngineStats, sum_stats
from tokenloom.distributed import parallel_state
from tokenloom.distributed.eplb import balanced_placement, imbalance, rank_loads, replicate
from tokenloom.distributed.expert_moves import ExpertMove, plan_moves
from tokenloom.distributed.expert_parallel import ExpertPlacement, init_expert_parallel
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.expert_replicas import ExpertReplicas
from tokenloom.model.layers.fused_moe import FusedMoE, grouped_experts
from tokenloom.model.prepack import can_prepack

LINEAR_8_OVER_2 = [0, 1, 2, 3, 4, 5, 6, 7]
# Experts 0 and 1 take most tokens, and the linear placement puts both on rank 0.
SKEWED = [400, 300, 20, 10, 30, 10, 20, 10]


def _per_rank(slots: list[int], num_ranks: int) -> list[list[int]]:
    per_rank = len(slots) // num_ranks
    return [slots[r * per_rank:(r + 1) * per_rank] for r in range(num_ranks)]


# ---- the placement ---------------------------------------------------------------------------------------------
def test_the_redundant_copies_go_to_the_experts_with_the_most_load_per_copy():
    # 400 and 300 get a second copy; two is the most on two ranks, so the third goes to the busiest one left.
    assert replicate(SKEWED, 3, num_ranks=2) == [2, 2, 1, 1, 2, 1, 1, 1]
    assert replicate([100, 1], 2, num_ranks=2) == [2, 2]  # no expert gets more copies than there are ranks


def test_a_skewed_load_is_spread_evenly_over_the_ranks():
    assert imbalance(rank_loads(SKEWED, LINEAR_8_OVER_2, 2)) == pytest.approx(730 / 400)
    balanced = balanced_placement(SKEWED, LINEAR_8_OVER_2, 2)
    assert imbalance(rank_loads(SKEWED, balanced, 2)) < 1.1
    assert sorted(balanced) == LINEAR_8_OVER_2  # no redundant slots: a permutation


def test_redundant_copies_split_a_hot_expert_over_two_ranks():
    load = [800, 10, 10, 10, 10, 10, 10, 10]
    start = ExpertPlacement(8, size=2).physical_experts(redundant=2)
    balanced = balanced_placement(load, start, 2)
    assert [0 in rank for rank in _per_rank(balanced, 2)] == [True, True]
    assert imbalance(rank_loads(load, balanced, 2)) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("seed", range(5))
def test_every_expert_keeps_a_copy_and_no_rank_holds_one_twice(seed):
    g = torch.Generator().manual_seed(seed)
    load = (torch.rand(16, generator=g) ** 4 * 1000).tolist()
    start = ExpertPlacement(16, size=4).physical_experts(redundant=4)
    balanced = balanced_placement(load, start, 4)
    assert set(balanced) == set(range(16)) and len(balanced) == 20
    assert all(max(Counter(rank).values()) == 1 for rank in _per_rank(balanced, 4))
    assert imbalance(rank_loads(load, balanced, 4)) <= imbalance(rank_loads(load, start, 4))


def test_a_placement_that_balances_no_better_is_not_taken():
    assert balanced_placement([10] * 8, LINEAR_8_OVER_2, 2) == LINEAR_8_OVER_2
    assert balanced_placement([0] * 8, LINEAR_8_OVER_2, 2) == LINEAR_8_OVER_2


def test_experts_that_stay_on_their_rank_keep_their_slots():
    current = [3, 0, 1, 2, 4, 5, 6, 7]
    balanced = balanced_placement(SKEWED, current, 2)
    moved = [slot for slot in range(8) if balanced[slot] != current[slot]]
    assert len(moved) <= 4  # one swap of two experts per rank at most
    assert all(balanced[slot] not in current[(slot // 4) * 4:(slot // 4 + 1) * 4] for slot in moved)


def test_imbalance_is_max_over_mean_and_one_without_load():
    assert imbalance([30, 10]) == pytest.approx(1.5)
    assert imbalance([0, 0]) == 1.0


# ---- moves between placements ------------------------------------------------------------------------------------
def test_a_slot_takes_an_expert_from_its_own_rank_before_the_network():
    current = [0, 1, 2, 3, 4, 5]  # rank 0: 0 1 2, rank 1: 3 4 5
    target = [1, 0, 4, 3, 5, 2]
    assert plan_moves(current, target, 2) == [
        ExpertMove(slot=0, expert=1, source=1), ExpertMove(slot=1, expert=0, source=0),  # in rank 0's memory
        ExpertMove(slot=2, expert=4, source=4),  # from rank 1
        ExpertMove(slot=4, expert=5, source=5), ExpertMove(slot=5, expert=2, source=2)]


def test_an_unchanged_placement_moves_nothing():
    assert plan_moves(LINEAR_8_OVER_2, LINEAR_8_OVER_2, 2) == []


# ---- routing over copies -------------------------------------------------------------------------------------------
def test_the_starting_slots_add_copies_of_the_next_ranks_experts():
    assert ExpertPlacement(8, size=2).physical_experts(redundant=2) == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    assert ExpertPlacement(8, size=2, strategy="round_robin").physical_experts(redundant=4) == [
        0, 2, 4, 6, 1, 3, 1, 3, 5, 7, 0, 2]


def test_each_pair_is_computed_on_exactly_one_rank_and_a_copied_experts_tokens_are_spread():
    slots = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # experts 0 and 1 on both ranks
    ids = torch.tensor([[0, 2]] * 6 + [[1, 5]] * 4)
    local = [ExpertReplicas(slots, 8, rank, 2).route(ids) for rank in range(2)]
    assert torch.equal((local[0] >= 0).long() + (local[1] >= 0).long(), torch.ones_like(ids))
    zero_on = [(local[r][:6, 0] >= 0).sum().item() for r in range(2)]
    assert zero_on == [3, 3]


def test_each_rank_counts_the_pairs_it_computed_per_logical_expert():
    slots = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    ids = torch.tensor([[0, 2]] * 6 + [[1, 5]] * 4)
    replicas = [ExpertReplicas(slots, 8, rank, 2) for rank in range(2)]
    for r in replicas:
        r.route(ids)
    counts = [r.take_load(ids.device) for r in replicas]
    assert (counts[0] + counts[1]).tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()
    assert counts[0].tolist() == [3, 2, 6, 0, 0, 0, 0, 0] and counts[1].tolist() == [3, 2, 0, 0, 0, 4, 0, 0]
    assert replicas[0].take_load(ids.device).sum() == 0  # taking it starts the next step's count


def test_two_ranks_with_copies_sum_to_the_whole_layer(monkeypatch):
    """Each rank's FusedMoE, built as the worker builds it under --enable-eplb with two redundant slots, loads its
    slots from the stacked tensors; the two partial outputs add up to all experts computed in one place."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(8, 8, 16, generator=g), torch.randn(8, 16, 4, generator=g)
    x = torch.randn(10, 16, generator=g)
    weights, ids = torch.rand(10, 2, generator=g), torch.tensor([[0, 1]] * 5 + [[4, 0]] * 5)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank=rank, size=2))
        init_expert_parallel(True, "linear", load_balancing=True, redundant_experts=2)
        try:
            experts = FusedMoE(num_experts=8, hidden_size=16, intermediate_size=4)
        finally:
            init_expert_parallel(False)
        assert experts.w13.shape == (5, 8, 16)
        experts.load("gate_up_proj", w13)
        experts.load("down_proj", w2)
        parts.append(experts.forward(x, weights, ids, reduce_results=False))
    torch.testing.assert_close(parts[0] + parts[1], grouped_experts(x, w13, w2, weights, ids))


def _rank_zero_of_two(monkeypatch, redundant: int) -> FusedMoE:
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank=0, size=2))
    init_expert_parallel(True, "linear", load_balancing=True, redundant_experts=redundant)
    try:
        return FusedMoE(num_experts=8, hidden_size=16, intermediate_size=4)
    finally:
        init_expert_parallel(False)


@pytest.mark.parametrize("prepacked", [False, True])
def test_a_re_placement_within_a_rank_keeps_the_layers_output(monkeypatch, prepacked):
    """Rank 0 swaps and re-copies its slots (no expert leaves it, so no other rank is needed): its weights move
    with the tables, stacked or prepacked for oneDNN, and it computes the same pairs to the same sum."""
    g = torch.Generator().manual_seed(1)
    experts = _rank_zero_of_two(monkeypatch, redundant=2)
    experts.load("gate_up_proj", torch.randn(8, 8, 16, generator=g))
    experts.load("down_proj", torch.randn(8, 16, 4, generator=g))
    if prepacked:
        if not can_prepack(torch.device("cpu")):
            pytest.skip("platform: this torch build cannot prepack for oneDNN")
        assert experts.method.pack(experts)
    x, weights = torch.randn(12, 16, generator=g), torch.rand(12, 2, generator=g)
    ids = torch.randint(0, 8, (12, 2), generator=g)
    before = experts.forward(x, weights, ids, reduce_results=False)
    assert experts.replicas.slots == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    experts.place([4, 3, 2, 1, 0, 4, 5, 6, 7, 0])
    assert experts.local_slots == {4: [0], 3: [1], 2: [2], 1: [3], 0: [4]}
    torch.testing.assert_close(experts.forward(x, weights, ids, reduce_results=False), before)


def test_replicas_stats_add_their_re_placements_and_keep_the_worst_imbalance():
    total = sum_stats([EngineStats(eplb_rebalances=2, eplb_experts_moved=3, eplb_imbalance=1.2,
                                   eplb_planned_imbalance=1.0), EngineStats(),
                       EngineStats(eplb_rebalances=1, eplb_experts_moved=4, eplb_imbalance=1.5,
                                   eplb_planned_imbalance=1.1)])
    assert (total.eplb_rebalances, total.eplb_experts_moved, total.eplb_imbalance,
            total.eplb_planned_imbalance) == (3, 7, 1.5, 1.1)
    assert sum_stats([EngineStats()]).eplb_imbalance is None


# ---- configuration -------------------------------------------------------------------------------------------------
def test_the_load_balancer_without_expert_parallel_is_a_config_error():
    with pytest.raises(ConfigError, match="^enable_eplb balances the experts of expert parallelism: it needs "
                                          "enable_expert_parallel"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, enable_eplb=True)


def test_its_settings_without_enable_eplb_are_a_config_error():
    with pytest.raises(ConfigError, match="^eplb_config and num_redundant_experts apply only with enable_eplb"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2)


def test_an_interval_of_zero_steps_is_a_config_error():
    with pytest.raises(ConfigError, match="^eplb_config step_interval must be an int >= 1"):
        EngineConfig.from_kwargs(enable_expert_parallel=True, enable_eplb=True, eplb_config={"step_interval": 0})


def test_redundant_experts_that_do_not_divide_over_the_ranks_are_a_config_error():
    with pytest.raises(ConfigError, match="^num_redundant_experts 3 does not divide over 2 expert-parallel ranks"):
        _moe_arch().check_tensor_parallel(2, expert_parallel=True, redundant_experts=3)


def test_more_redundant_experts_than_the_ranks_have_room_for_are_a_config_error():
    with pytest.raises(ConfigError, match=r"^num_redundant_experts 10 gives each of 2 ranks 9 expert slots, more "
                                          r"than the model's 8 experts \(at most 8\)"):
        _moe_arch().check_tensor_parallel(2, expert_parallel=True, redundant_experts=10)
    _moe_arch().check_tensor_parallel(2, expert_parallel=True, redundant_experts=8)


def _moe_arch() -> ArchConfig:
    return ArchConfig("Qwen3MoeForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1,
                      num_heads=6, num_kv_heads=6, head_dim=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48)


def test_the_vllm_flags_set_the_load_balancer():
    from tokenloom.entrypoints.cli import build_parser
    args = build_parser("serve").parse_args(
        ["serve", "m", "-tp", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config",
         '{"window_size": 10, "step_interval": 20, "log_balancedness": true}', "--num-redundant-experts", "2"])
    eplb = EngineConfig.from_args(args).parallel.eplb
    assert (eplb.window_size, eplb.step_interval, eplb.num_redundant_experts, eplb.log_balancedness) == (
        10, 20, 2, True)
    assert EngineConfig.from_args(build_parser("serve").parse_args(["serve", "m"])).parallel.eplb is None


def test_fastdeploys_eplb_config_spelling_turns_it_on_with_its_redundant_experts():
    parallel = EngineConfig.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True,
                                        eplb_config='{"enable_eplb": true, "redundant_experts_num": 2}').parallel
    assert parallel.enable_eplb and parallel.redundant_experts == 2


def test_num_redundant_experts_contradicting_the_eplb_config_is_a_config_error():
    with pytest.raises(ConfigError, match="^num_redundant_experts 2 contradicts eplb_config's 4"):
        EngineConfig.from_kwargs(enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=2,
                                 eplb_config={"num_redundant_experts": 4})
