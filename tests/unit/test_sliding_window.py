"""Sliding-window attention on a tiny random Mistral whose window (8 tokens) is far shorter than its prompts,
against transformers on the same weights: prefill, prefill split over the paged cache, chunked prefill
mixed with decodes, and greedy generation well past the window. Every layer is windowed, so the scheduler
frees the KV blocks behind the window: requests hold a few blocks whatever their length, and prefix
caching still hits (and stays exact) on blocks freed that way.

Tolerance: float32 on both sides, as tests/unit/test_reference_tiny.py (final logits within 5e-5,
greedy token-identical).
"""
from __future__ import annotations

import helpers
import pytest
import torch
import transformers

from tokenloom.config import EngineConfig
from tokenloom.engine.core import EngineCore
from tokenloom.model.loader import load_model
from tokenloom.scheduler.block_pool import NULL_BLOCK

WINDOW = 8
LOGIT_TOL = 5e-5
PROMPT_LENGTHS = [3, 9, 20, 37, 61]  # shorter than, just past, and several windows past it
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(folder, transformers model): a tiny random Mistral with an 8-token window."""
    config = transformers.MistralConfig(**{**helpers.TINY_COMMON, "num_key_value_heads": 2,
                                           "sliding_window": WINDOW})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = helpers.save_tiny_model(hf, str(tmp_path_factory.mktemp("mistral_window")))
    return folder, hf


@pytest.fixture(scope="module")
def prompts():
    return helpers.random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=3)


@pytest.fixture(scope="module")
def want(mistral, prompts):
    """transformers' greedy continuation of each prompt, NEW_TOKENS long (shorter runs compare a prefix)."""
    return [helpers.hf_greedy(mistral[1], p, NEW_TOKENS) for p in prompts]


def _core(folder: str, **engine_args) -> EngineCore:
    args = dict(device="cpu", dtype="float32", num_blocks=64, block_size=4, log_stats_interval=0)
    return EngineCore(EngineConfig.from_kwargs(model=folder, **{**args, **engine_args}), progress=False)


def test_every_layer_of_the_model_attends_within_the_window(mistral):
    model = load_model(mistral[0], torch.float32, torch.device("cpu"), progress=False).model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW, WINDOW]


def test_prefill_logits_past_the_window_match_transformers(mistral, prompts):
    folder, hf = mistral
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    want = helpers.hf_last_logits(hf, prompts)
    assert (helpers.last_logits(model, prompts) - want).abs().max().item() < LOGIT_TOL
    split = helpers.last_logits(model, prompts, block_size=4, split_at=13)  # the 2nd chunk reads the paged cache
    assert (split - want).abs().max().item() < LOGIT_TOL


def test_greedy_generation_far_past_the_window_is_token_identical_to_transformers(mistral, prompts, want):
    got = helpers.generate_tokens(_core(mistral[0]), prompts, helpers.greedy_params(NEW_TOKENS))
    for prompt, tokens, expected in zip(prompts, got, want):
        assert tokens == expected, helpers.describe_divergence(mistral[1], prompt, tokens, expected)


def test_chunked_prefill_mixed_with_decodes_matches_transformers(mistral, prompts, want):
    """A 7-token step budget and 5-token chunks: prompts prefill over many steps beside other decodes."""
    core = _core(mistral[0], max_num_batched_tokens=7, long_prefill_token_threshold=5)
    got = helpers.generate_tokens(core, prompts, helpers.greedy_params(24))
    for prompt, tokens, expected in zip(prompts, got, want):
        assert tokens == expected[:24], f"prompt of {len(prompt)} tokens"


def test_blocks_behind_the_window_are_freed_while_a_request_runs(mistral, prompts, want):
    """A 61-token prompt and 40 new tokens span 26 blocks of 4; prefilled 16 tokens a step, the request
    holds only the blocks of its window and of the step's chunk."""
    core = _core(mistral[0], max_num_batched_tokens=16, long_prefill_token_threshold=16)
    core.add_request(helpers.make_request("long", prompts[-1], helpers.greedy_params(NEW_TOKENS)))
    held = []

    def watch(core, _):
        for request in core.scheduler.running:
            held.append(sum(b != NULL_BLOCK for b in request.block_ids))

    tokens = helpers.run_to_completion(core, on_step=watch)[("long", 0)]
    assert tokens == want[-1]
    assert max(held) <= -(-(WINDOW + 16) // 4) + 1  # the window and one 16-token chunk
    assert core.stats()["kv_blocks_used"] == 0


def test_a_request_longer_than_the_whole_kv_cache_runs_when_its_window_fits(mistral, prompts, want):
    """16 blocks of 4 tokens hold 64 tokens; a 101-token request runs, and the context is not clamped."""
    core = _core(mistral[0], num_blocks=16, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    assert core.max_model_len == helpers.TINY_COMMON["max_position_embeddings"]
    assert helpers.generate_tokens(core, prompts[-1:], helpers.greedy_params(NEW_TOKENS))[0] == want[-1]


def test_prefix_cache_hits_on_blocks_freed_behind_the_window_stay_exact(mistral, prompts, want):
    """The first request frees its prompt's early blocks, which keep their cache entries; the second, same
    prompt then hits them (reading only the blocks its window needs) and still matches transformers."""
    core = _core(mistral[0])
    prompt = prompts[3]
    assert helpers.generate_tokens(core, [prompt], helpers.greedy_params(20), prefix="a")[0] == want[3][:20]
    core.add_request(helpers.make_request("b", prompt, helpers.greedy_params(20)))
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    assert outputs[0].num_cached_tokens == 36  # the 9 full blocks of the 37-token prompt
    assert [t for o in outputs for t in o.new_token_ids] == want[3][:20]


def test_a_window_as_long_as_the_context_is_no_window(tmp_path):
    config = transformers.MistralConfig(**{**helpers.TINY_COMMON, "num_key_value_heads": 2, "sliding_window": 4096})
    folder = helpers.save_tiny_model(transformers.AutoModelForCausalLM.from_config(config), str(tmp_path))
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    assert all(layer.self_attn.attn.sliding_window is None for layer in model.model.layers)
    assert _core(folder).kv_manager.sliding_window is None


def test_qwen2_configs_that_switch_the_window_off_attend_over_everything(tmp_path):
    config = transformers.Qwen2Config(**{**helpers.TINY_COMMON, "num_key_value_heads": 2, "sliding_window": 16,
                                         "use_sliding_window": False})
    folder = helpers.save_tiny_model(transformers.AutoModelForCausalLM.from_config(config), str(tmp_path))
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    assert all(layer.self_attn.attn.sliding_window is None for layer in model.model.layers)
    assert _core(folder).kv_manager.sliding_window is None
