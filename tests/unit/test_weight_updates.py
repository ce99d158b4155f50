"""New weights without a restart (from disk, from tensors, broadcast by a trainer process over gloo), pause and
continue, sleep and wake: after each, the engine's greedy output equals transformers on the weights it should
now serve."""
from __future__ import annotations

import os
import subprocess
import sys

import helpers
import pytest

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.weight_control import WeightControlError

PROMPTS = [[5, 17, 99, 23, 41, 7], [3, 3, 250, 11]]
TOKENS = 8
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """The tiny Llama's shapes with other values (seed 1): a folder and the transformers model."""
    model = helpers.build_tiny_model("llama", seed=1)
    return helpers.save_tiny_model(model, str(tmp_path_factory.mktemp("llama_seed1"))), model


def greedy(core, prompts=PROMPTS) -> list[list[int]]:
    return helpers.generate_tokens(core, prompts, helpers.greedy_params(TOKENS))


def expected(hf_model, prompts=PROMPTS) -> list[list[int]]:
    return [helpers.hf_greedy(hf_model, p, TOKENS) for p in prompts]


def test_an_update_from_disk_serves_the_new_weights(make_core, tiny_models, new_weights):
    core = make_core("llama")
    assert greedy(core) == expected(tiny_models("llama")[1])
    core.update_weights_from_disk(new_weights[0])
    assert greedy(core) == expected(new_weights[1])


def test_an_update_from_tensors_serves_them(make_core, new_weights):
    core = make_core("llama")
    core.update_weights(dict(new_weights[1].state_dict()))
    assert greedy(core) == expected(new_weights[1])


def test_an_update_to_another_architecture_is_refused(make_core, tiny_models):
    with pytest.raises(WeightControlError, match="architecture is 'Qwen3ForCausalLM'"):
        make_core("llama").update_weights_from_disk(tiny_models("qwen3")[0])


def test_an_update_with_other_shapes_is_refused_and_the_old_weights_keep_serving(make_core, tiny_models):
    core = make_core("llama")
    with pytest.raises(WeightControlError, match="num_kv_heads is 2, the serving model's is 4"):
        core.update_weights_from_disk(tiny_models("llama_tied_gqa")[0])
    assert greedy(core) == expected(tiny_models("llama")[1])


def test_tensors_that_do_not_fit_are_refused_and_the_old_weights_keep_serving(make_core, tiny_models):
    core = make_core("llama")
    incomplete = dict(list(tiny_models("llama")[1].state_dict().items())[:-3])
    with pytest.raises(WeightControlError, match="do not fit the serving model"):
        core.update_weights(incomplete)
    assert greedy(core) == expected(tiny_models("llama")[1])


def test_the_prefix_cache_never_serves_kv_computed_with_the_old_weights(make_core, new_weights):
    core = make_core("llama", enable_prefix_caching=True, block_size=4)
    long_prompt = list(range(10, 40))
    greedy(core, [long_prompt])  # its blocks are cached under the old weights
    core.update_weights_from_disk(new_weights[0])
    assert greedy(core, [long_prompt]) == expected(new_weights[1], [long_prompt])


def test_paused_requests_wait_unscheduled_and_finish_after_continue(make_core, tiny_models):
    core = make_core("llama")
    core.add_request(helpers.make_request("r", PROMPTS[0], helpers.greedy_params(TOKENS)))
    first = core.step()[0].new_token_ids
    core.pause_generation()
    assert core.step() == [] and not core.has_unfinished_requests()
    core.continue_generation()
    rest = helpers.run_to_completion(core)[("r", 0)]
    assert first + rest == expected(tiny_models("llama")[1])[0]


@pytest.mark.parametrize("level", [1, 2])
def test_after_sleep_and_wake_the_engine_serves_the_same_weights(make_core, tiny_models, level):
    core = make_core("llama")
    core.sleep(level)
    assert core.is_sleeping()
    core.wake_up()
    assert not core.is_sleeping()
    assert greedy(core) == expected(tiny_models("llama")[1])


def test_sleep_needs_an_idle_engine(make_core):
    core = make_core("llama")
    core.add_request(helpers.make_request("r", PROMPTS[0], SamplingParams(max_tokens=4)))
    with pytest.raises(WeightControlError, match="requests in flight"):
        core.sleep(1)


def test_an_asleep_engine_refuses_an_update(make_core, new_weights):
    core = make_core("llama")
    core.sleep(1)
    with pytest.raises(WeightControlError, match="asleep"):
        core.update_weights_from_disk(new_weights[0])
    core.wake_up()


def _trainer(port: int, world_size: int, kind: str, seed: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.path.dirname(TESTS_DIR)])}
    return subprocess.Popen([sys.executable, os.path.join(TESTS_DIR, "weight_sender.py"), str(port),
                             str(world_size), kind, str(seed)], env=env)


def test_a_trainer_process_sends_the_weights_over_gloo(make_core, new_weights):
    core = make_core("llama")
    port = helpers.free_port()
    trainer = _trainer(port, 2, "llama", 1)
    try:
        core.init_weights_update_group("127.0.0.1", port, 1, 2, "gloo")
        core.update_weights_from_distributed(helpers.tensor_metas_json(new_weights[1]))
    finally:
        assert trainer.wait(60) == 0
    core.destroy_weights_update_group()
    assert greedy(core) == expected(new_weights[1])


@pytest.mark.tp
@pytest.mark.slow  # three worker processes and a trainer: ~25 s quiet; runs in the CI soak step
def test_three_ranks_take_updates_from_disk_and_from_a_trainer(make_core, tmp_path):
    old, new = helpers.build_tp3_model(0), helpers.build_tp3_model(1)
    old_folder = helpers.save_tiny_model(old, str(tmp_path / "old"))
    new_folder = helpers.save_tiny_model(new, str(tmp_path / "new"))
    from tokenloom.config import EngineConfig
    from tokenloom.engine.core import EngineCore
    core = EngineCore(EngineConfig.from_kwargs(model=old_folder, dtype="float32", device="cpu", log_stats_interval=0,
                                               kv_cache_memory=0.05, tensor_parallel_size=3), progress=False)
    try:
        core.update_weights_from_disk(new_folder)
        assert greedy(core) == expected(new)
        port = helpers.free_port()
        trainer = _trainer(port, 4, "tp3", 0)
        try:
            core.init_weights_update_group("127.0.0.1", port, 1, 4, "gloo")
            core.update_weights_from_distributed(helpers.tensor_metas_json(old))
        finally:
            assert trainer.wait(60) == 0
        assert greedy(core) == expected(old)
    finally:
        core.shutdown()
