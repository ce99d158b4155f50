"""The worker's start-up phases and what they hand each other: the attention backend chosen once and given
to the model and the runner, the KV cache sized from the measured memory, a runner built with everything it
uses (nothing set on it afterwards), and one batch layout for the runner and the draft model."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
from helpers import greedy_params, make_request, random_prompts

import tokenloom
from tokenloom.config import EngineConfig
from tokenloom.model.layers.attention import TorchAttention
from tokenloom.model.layers.attention_native import NativeAttention
from tokenloom.worker.batch_layout import step_layout
from tokenloom.worker.kv_cache import kv_bytes_per_block, size_kv_cache
from tokenloom.worker.phases import WORKER_PHASES, init_device, load_weights, measure_memory


def test_an_executor_drives_the_phases_by_name_in_order(make_core):
    worker = make_core("llama").executor.worker
    assert list(worker.phase_seconds) == list(WORKER_PHASES)
    with pytest.raises(ValueError, match="unknown worker phase"):
        worker.run_phase("compile")


def test_the_kv_cache_is_sized_from_the_measured_memory(tiny_models):
    folder, _ = tiny_models("llama")
    config = EngineConfig.from_kwargs(model=folder, device="cpu", dtype="float32", kv_cache_memory=0.01)
    plan = init_device(config)
    weights = load_weights(config, plan, progress=False)
    budget = measure_memory(config, plan, weights)
    assert budget == int(0.01 * 2 ** 30)  # on CPU the measured memory is the configured budget
    arch = weights.target.arch
    per_block = kv_bytes_per_block(arch, config.cache.block_size, plan.kv_dtype)
    for given in (budget, budget // 3):
        kv = size_kv_cache(config, arch, plan.attention.another(), plan.kv_dtype, plan.device, given, None,
                           scratch_block=False, encoder=False, trained_len=None)
        assert kv.num_blocks == given // per_block
        assert kv.caches[0].shape[1] == kv.num_blocks and len(kv.caches) == arch.num_layers
    fixed = EngineConfig.from_kwargs(model=folder, device="cpu", dtype="float32", num_blocks=7)
    assert measure_memory(fixed, plan, weights) is None  # --num-blocks: nothing to measure


def test_the_backend_is_one_instance_given_to_the_model_and_the_runner(make_core):
    """Two engines in one process on different backends: each model's layers hold its engine's impls."""
    torch_core = make_core("llama", attention_backend="torch")
    runner = torch_core.executor.worker.runner
    assert runner.attention.name == "torch" and runner.attention is torch_core.executor.worker.plan.attention
    impls = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert all(type(impl) is TorchAttention for impl in impls)
    if tokenloom.kernels.enabled():
        native = make_core("llama", attention_backend="native").executor.worker.runner
        assert native.attention.name == "native"
        assert all(type(layer.self_attn.attn) is NativeAttention for layer in native.model.model.layers)
        assert runner.attention.name == "torch"  # no module state: the first engine's choice stands


def test_the_runner_is_built_with_its_forward_path(make_core, make_llm):
    eager = make_core("llama").executor.worker.runner
    assert eager.forward.kind == "eager" and eager.forward.native_stack is None and eager.forward.graphs is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        eager.forward.kind = "native_stack"  # the path is fixed at construction
    if tokenloom.kernels.enabled():
        fast = make_llm().engine.executor.worker.runner
        assert fast.forward.kind == "native_stack" and fast.forward.native_stack is not None


def test_nothing_is_set_on_a_runner_outside_it():
    root = pathlib.Path(tokenloom.__file__).parent
    assigned = [f"{path.relative_to(root)}: {line.strip()}" for path in root.rglob("*.py")
                if path.name != "runner.py"
                for line in path.read_text().splitlines() if re.search(r"\brunner\.\w+ =[^=]", line)]
    assert assigned == []


def test_the_draft_model_and_the_runner_lay_out_a_step_alike(make_core, tiny_models):
    """A mixed step (decodes of several context lengths and a prefill chunk): the draft model's layout of the
    same chunks is the runner's, row for row."""
    core = make_core("llama", block_size=4)
    drafter = make_core("llama", block_size=4, speculative_config={
        "method": "draft_model", "model": tiny_models("llama")[0], "num_speculative_tokens": 2}
    ).executor.worker.runner.drafter
    prompts = random_prompts(3, [5, 11, 7], 512, seed=3)
    for i, prompt in enumerate(prompts):
        core.add_request(make_request(f"r{i}", prompt, greedy_params(8)))
        core.step()
    core.add_request(make_request("late", random_prompts(1, [9], 512, seed=4)[0], greedy_params(8)))
    step = core.scheduler.schedule()
    runner = core.executor.worker.runner
    runner.update_states(step)
    scheduled = [(runner.requests[k], n) for k, n in step.num_scheduled_tokens.items()]
    assert {n for _, n in scheduled} != {1}  # decodes and a prefill in one step
    ours = step_layout(scheduled, {}, runner.block_size).batch
    chunks = [(r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n], r.num_computed_tokens)
              for r, n in scheduled]
    theirs = drafter.layout([r.block_ids for r, _ in scheduled], chunks)
    assert theirs.input_ids == ours.input_ids and theirs.positions == ours.positions
    assert theirs.slot_mapping == ours.slot_mapping and theirs.spans == ours.spans and theirs.order == ours.order
    assert [s.num_tokens for s in ours.spans][0] == 1  # decodes first
