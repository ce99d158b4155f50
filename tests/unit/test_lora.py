"""LoRA adapters against transformers + PEFT on the same weights: random adapters made by PEFT
(`init_lora_weights=False`, so B is non-zero) on tiny random Llama, Qwen3 and Gemma 3 models, served from the
engine's slots in mixed batches.

Tolerance: float32 on both sides; greedy output token-identical, prompt logprobs within 5e-5 (the tiny
models' logit tolerance, test_reference_tiny.py).
"""
from __future__ import annotations

import shutil

import helpers
import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.core.lora_request import LoRARequest, LoRASlotLoad
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.lora.adapter import LoRAAdapterError

LOGPROB_TOL = 5e-5
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts():
    return helpers.random_prompts(3, [5, 17, 33], 512, seed=4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    hf = helpers.build_tiny_gemma3()
    return helpers.save_tiny_model(hf, str(tmp_path_factory.mktemp("tiny_gemma3_lora"))), hf


@pytest.fixture(scope="module")
def adapters(tiny_models, gemma3, tmp_path_factory):
    """adapters(kind, n) -> (LoRARequest, PEFT model): adapter n on tiny model `kind` (built once)."""
    made: dict = {}

    def get(kind: str, n: int = 1, **peft_args):
        key = (kind, n, tuple(sorted(peft_args.items())))
        if key not in made:
            hf = gemma3[1] if kind == "gemma3" else tiny_models(kind)[1]
            folder = str(tmp_path_factory.mktemp(f"lora_{kind}_{n}"))
            path, peft_model = helpers.make_peft_adapter(hf, folder, seed=n, **peft_args)
            made[key] = (LoRARequest(f"{kind}-{n}", len(made) + 1, path), peft_model)
        return made[key]

    return get


@pytest.fixture(scope="module")
def want():
    """want(reference model, prompt) -> its greedy tokens, computed once per pair (transformers is the slow side)."""
    done: dict = {}

    def get(model, prompt: list[int]) -> list[int]:
        key = (id(model), tuple(prompt))
        if key not in done:
            done[key] = helpers.hf_greedy(model, prompt, MAX_TOKENS)
        return done[key]

    return get


def _core(make_core, gemma3, kind: str, **engine_args):
    if kind == "gemma3":
        args = dict(device="cpu", dtype="float32", log_stats_interval=0, kv_cache_memory=0.05)
        return EngineCore(EngineConfig.from_kwargs(model=gemma3[0], **{**args, **engine_args}), progress=False)
    return make_core(kind, **engine_args)


def _add(core, rid: str, prompt: list[int], lora: LoRARequest | None, params=None) -> None:
    req = helpers.make_request(rid, prompt, params or helpers.greedy_params(MAX_TOKENS))
    req.lora_request = lora
    core.add_request(req)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])  # Qwen3: the mixed-batch test below
def test_adapter_greedy_output_is_token_identical_to_transformers_with_peft(kind, make_core, gemma3, adapters,
                                                                            prompts, want):
    lora, reference = adapters(kind)
    core = _core(make_core, gemma3, kind, enable_lora=True)
    for i, prompt in enumerate(prompts):
        _add(core, f"r{i}", prompt, lora)
    out = helpers.run_to_completion(core)
    for i, prompt in enumerate(prompts):
        assert out[(f"r{i}", 0)] == want(reference, prompt), f"prompt {i}"


def test_adapter_prompt_logprobs_agree_with_transformers_with_peft(make_core, gemma3, adapters, prompts):
    lora, reference = adapters("llama")
    core = _core(make_core, gemma3, "llama", enable_lora=True)
    prompt = prompts[2]
    _add(core, "p", prompt, lora, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    got = []
    while core.has_unfinished_requests():
        for out in core.step():
            got = got or out.prompt_logprobs
    want = helpers.hf_log_softmax(reference, prompt)
    diffs = [abs(entry[0][1] - want[t - 1, prompt[t]].item()) for t, entry in enumerate(got) if entry is not None]
    assert len(diffs) == len(prompt) - 1 and max(diffs) < LOGPROB_TOL


def test_base_requests_in_a_mixed_batch_are_unchanged_by_adapter_requests_beside_them(make_core, gemma3, adapters,
                                                                                        prompts, want):
    """Base rows, two adapters' rows, one step: each row gets its own model, nothing leaks between them."""
    (lora1, ref1), (lora2, ref2) = adapters("qwen3", 1), adapters("qwen3", 2)
    alone = _core(make_core, gemma3, "qwen3")
    base_alone = helpers.generate_tokens(alone, prompts, helpers.greedy_params(MAX_TOKENS))
    core = _core(make_core, gemma3, "qwen3", enable_lora=True, max_loras=2)
    for i, prompt in enumerate(prompts):
        _add(core, f"b{i}", prompt, None)
        _add(core, f"x{i}", prompt, lora1)
        _add(core, f"y{i}", prompt, lora2)
    out = helpers.run_to_completion(core)
    for i, prompt in enumerate(prompts):
        assert out[(f"b{i}", 0)] == base_alone[i]
        assert out[(f"x{i}", 0)] == want(ref1, prompt)
        assert out[(f"y{i}", 0)] == want(ref2, prompt)
    assert out[("x0", 0)] != out[("y0", 0)] != out[("b0", 0)]


def test_more_adapters_than_slots_wait_for_one_and_all_finish_correctly(make_core, gemma3, adapters, prompts, want):
    """One slot, three adapters and base requests: adapter requests take turns in the slot (least recently
    used evicted), base requests run meanwhile, and every output is its own model's."""
    loras = [adapters("llama", n) for n in (1, 2, 3)]
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_loras=1)
    for n, (lora, _) in enumerate(loras):
        _add(core, f"a{n}", prompts[n], lora)
    _add(core, "base", prompts[0], None)
    steps_with_two_adapters = []
    out = helpers.run_to_completion(core, on_step=lambda c, _: steps_with_two_adapters.append(
        len({r.lora_int_id for r in c.scheduler.running if r.lora_int_id}) > 1))
    for n, (lora, reference) in enumerate(loras):
        assert out[(f"a{n}", 0)] == want(reference, prompts[n])
    assert not any(steps_with_two_adapters)
    assert core.scheduler.lora_slots.num_loads == 3


def test_adapters_kept_in_host_memory_go_back_into_a_slot_without_their_files_being_read_again(make_core, gemma3,
                                                                                             adapters, prompts, want):
    """--max-cpu-loras 2 over one slot: adapters 1, 2, 1, 3, 2 in turn read 1, 2, 3 and 2 again (1 was kept, then
    2 was the least recently used of the two kept), and every output is its own model's."""
    loras = {n: adapters("llama", n) for n in (1, 2, 3)}
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_loras=1, max_cpu_loras=2)
    slots = core.executor.worker.runner.lora
    reads: list[str] = []
    read_files = slots.reader
    slots.reader = lambda lora: reads.append(lora.lora_name) or read_files(lora)
    for turn, n in enumerate((1, 2, 1, 3, 2)):
        lora, reference = loras[n]
        _add(core, f"t{turn}", prompts[0], lora)
        assert helpers.run_to_completion(core)[(f"t{turn}", 0)] == want(reference, prompts[0])
    assert reads == ["llama-1", "llama-2", "llama-3", "llama-2"]


def test_an_adapter_removed_while_its_requests_run_serves_them_to_the_end(make_core, gemma3, adapters, prompts,
                                                                         want):
    """Unloading takes the adapter from the server's names (new requests get 404, test_lora_serving.py); the
    request already running keeps its slot, which another adapter's request waiting for the one slot does not
    take until it finishes, and both end with their own model's output."""
    (lora1, ref1), (lora2, ref2) = adapters("llama", 1), adapters("llama", 2)
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_loras=1)
    core.add_lora(lora1.lora_name, lora1.lora_int_id, lora1.lora_path)
    _add(core, "r", prompts[2], lora1)
    removed_at_step = 2

    def remove_then_ask_for_another(c, steps: int) -> None:
        if steps == removed_at_step:
            c.remove_lora(lora1.lora_int_id)
            _add(c, "other", prompts[1], lora2)

    out = helpers.run_to_completion(core, on_step=remove_then_ask_for_another)
    assert out[("r", 0)] == want(ref1, prompts[2])
    assert out[("other", 0)] == want(ref2, prompts[1])
    assert len(out[("r", 0)]) == MAX_TOKENS > removed_at_step


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(make_core, gemma3, adapters, prompts, want):
    """The same long prompt under adapter 1, then adapter 2, then the base model: each finds no cached prefix
    of the others', and each output is its own model's."""
    (lora1, ref1), (lora2, ref2) = adapters("llama", 1), adapters("llama", 2)
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_loras=2)
    prompt = prompts[2]
    for rid, lora, reference in (("one", lora1, ref1), ("two", lora2, ref2), ("again", lora1, ref1)):
        _add(core, rid, prompt, lora)
        out = helpers.run_to_completion(core)
        assert out[(rid, 0)] == want(reference, prompt)
    hits = core.kv_manager.prefix_hits
    assert hits == (len(prompt) - 1) // 16 * 16  # only "again" hit: adapter 1's own blocks


def test_rslora_scaling_matches_peft(make_core, gemma3, adapters, prompts, want):
    lora, reference = adapters("llama", 4, r=4, alpha=32, use_rslora=True, targets=("q_proj", "v_proj", "down_proj"))
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_lora_rank=8)
    _add(core, "r", prompts[1], lora)
    assert helpers.run_to_completion(core)[("r", 0)] == want(reference, prompts[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_slots_hold_an_adapter_saved_in_that_dtype_exactly(dtype, make_core, gemma3, tiny_models, prompts,
                                                                      tmp_path):
    """--lora-dtype: an adapter whose weights are 16-bit values loses nothing in 16-bit slots, and the engine's
    output is still transformers + PEFT's."""
    path, reference = helpers.make_peft_adapter(tiny_models("llama")[1], str(tmp_path), seed=8,
                                                round_to=getattr(torch, dtype))
    core = _core(make_core, gemma3, "llama", enable_lora=True, lora_dtype=dtype)
    lora = LoRARequest("sixteen", 8, path)
    for i, prompt in enumerate(prompts):
        _add(core, f"r{i}", prompt, lora)
    out = helpers.run_to_completion(core)
    assert core.executor.worker.runner.lora.targets[(0, "q_proj")].a.dtype == getattr(torch, dtype)
    for i, prompt in enumerate(prompts):
        assert out[(f"r{i}", 0)] == helpers.hf_greedy(reference, prompt, MAX_TOKENS), f"prompt {i}"


def test_an_adapter_over_the_rank_limit_is_refused_naming_the_limit(make_core, gemma3, adapters, prompts):
    lora, _ = adapters("llama", 5, r=16)
    core = _core(make_core, gemma3, "llama", enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="rank 16, over --max-lora-rank 8"):
        _add(core, "r", prompts[0], lora)
    assert not core.has_unfinished_requests()


def test_an_adapter_for_another_base_model_is_refused_naming_the_shape(make_core, gemma3, adapters, prompts):
    lora, _ = adapters("gemma3")  # head_dim 16: its q/k/v shapes do not fit tiny Llama's
    core = _core(make_core, gemma3, "llama", enable_lora=True)
    with pytest.raises(LoRAAdapterError, match="wrong base model"):
        _add(core, "r", prompts[0], LoRARequest("other", 99, lora.lora_path))


@pytest.mark.parametrize("damage", ["no_config", "no_weights", "truncated_weights", "not_json"])
def test_missing_or_corrupt_adapter_files_are_refused_in_one_line(damage, make_core, gemma3, adapters, prompts,
                                                                  tmp_path):
    lora, _ = adapters("llama")
    folder = tmp_path / "adapter"
    shutil.copytree(lora.lora_path, folder)
    if damage == "no_config":
        (folder / "adapter_config.json").unlink()
    elif damage == "no_weights":
        (folder / "adapter_model.safetensors").unlink()
    elif damage == "truncated_weights":
        (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    else:
        (folder / "adapter_config.json").write_text("{not json")
    core = _core(make_core, gemma3, "llama", enable_lora=True)
    with pytest.raises(LoRAAdapterError) as info:
        _add(core, "r", prompts[0], LoRARequest("broken", 42, str(folder)))
    assert "\n" not in str(info.value)


def test_an_adapter_request_to_an_engine_without_lora_is_refused(make_core, gemma3, adapters, prompts):
    lora, _ = adapters("llama")
    core = _core(make_core, gemma3, "llama")
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        _add(core, "r", prompts[0], lora)


def test_slot_buffers_hold_a_lower_rank_adapter_zero_padded(make_core, gemma3, adapters):
    """Rank 4 in rank-16 slots: the padding adds nothing (its A rows and B columns are zero)."""
    lora, _ = adapters("llama", 6, r=4)
    core = _core(make_core, gemma3, "llama", enable_lora=True)
    runner = core.executor.worker.runner
    runner.lora.apply([LoRASlotLoad(slot=0, lora=lora)])
    target = runner.lora.targets[(0, "q_proj")]
    assert torch.count_nonzero(target.a[0, 4:]) == 0 and torch.count_nonzero(target.b[0, 4:]) == 0
    assert torch.count_nonzero(target.a[0, :4]) > 0


@pytest.mark.tp
def test_tensor_parallel_adapter_output_equals_one_rank_and_peft(tiny_models, adapters, prompts, want):
    """TP=2, two KV heads: q/k/v/gate/up hold their rows of B, o/down their columns of A, the deltas summed
    by the all-reduce with the partial sums."""
    lora, reference = adapters("llama_tied_gqa")
    core = EngineCore(EngineConfig.from_kwargs(model=tiny_models("llama_tied_gqa")[0], dtype="float32", device="cpu",
                                               log_stats_interval=0, kv_cache_memory=0.05, tensor_parallel_size=2,
                                               enable_lora=True), progress=False)
    try:
        for i, prompt in enumerate(prompts):
            _add(core, f"r{i}", prompt, lora)
            _add(core, f"b{i}", prompt, None)
        out = helpers.run_to_completion(core)
    finally:
        core.shutdown()
    _, hf = tiny_models("llama_tied_gqa")
    for i, prompt in enumerate(prompts):
        assert out[(f"r{i}", 0)] == want(reference, prompt)
        assert out[(f"b{i}", 0)] == want(hf, prompt)
