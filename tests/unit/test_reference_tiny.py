"""Tiny random Llama / Mistral / Qwen2 / Qwen3 models built with transformers, saved as HF folders, loaded by
our engine, and compared against transformers on the same weights.

Tolerance policy: float32 on both sides, so final-position logits must agree to LOGIT_TOL (measured max abs
diff about 5e-6 on logits of magnitude ~6), and greedy generation must be token-identical.
"""
from __future__ import annotations

import pytest
import torch

import helpers
from tokenloom.model.loader import load_model

LOGIT_TOL = 1e-4
KINDS = list(helpers.TINY_VARIANTS)
PROMPT_LENGTHS = [1, 5, 16, 17, 33, 64, 100]


@pytest.fixture(scope="module")
def prompts():
    return helpers.random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=1)


@pytest.fixture(scope="module")
def ours(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            folder, _ = tiny_models(kind)
            cache[kind] = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
        return cache[kind]

    return get


def test_variants_exercise_the_features_they_name(ours):
    assert ours("llama3_rope").config.rope_scaling["rope_type"] == "llama3"
    tied = ours("llama_tied_gqa")
    assert tied.config.tie_word_embeddings and tied.lm_head is None
    assert tied.config.num_kv_heads < tied.config.num_heads
    assert ours("qwen2").config.attention_bias
    assert ours("qwen3").config.qk_norm and ours("qwen3").config.head_dim == 32
    assert type(ours("mistral")).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize("kind", KINDS)
def test_final_logits_match_transformers_in_one_flat_batch(kind, tiny_models, ours, prompts):
    _, hf = tiny_models(kind)
    got = helpers.last_logits(ours(kind), prompts)
    want = helpers.hf_last_logits(hf, prompts)
    diff = (got - want).abs().max().item()
    print(f"{kind}: max abs logit diff {diff:.2e}")
    assert diff < LOGIT_TOL


@pytest.mark.parametrize("kind", ["llama", "llama_tied_gqa", "qwen3"])
def test_final_logits_match_when_prefill_is_split_over_the_paged_cache(kind, tiny_models, ours, prompts):
    """The second chunk attends to the first through the paged KV cache (block size 4: many blocks)."""
    _, hf = tiny_models(kind)
    got = helpers.last_logits(ours(kind), prompts, block_size=4, split_at=7)
    want = helpers.hf_last_logits(hf, prompts)
    assert (got - want).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_is_token_identical_to_transformers(kind, tiny_models, make_core, prompts):
    _, hf = tiny_models(kind)
    core = make_core(kind)
    got = helpers.generate_tokens(core, prompts, helpers.greedy_params(32))
    for prompt, tokens in zip(prompts, got):
        assert tokens == helpers.hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens"
    assert core.stats()["kv_blocks_used"] == 0
