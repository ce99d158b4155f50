"""Tiny random Llama / Mistral / Qwen2 / Qwen3 models built with transformers, saved as HF folders, loaded by
our engine, and compared against transformers on the same weights.

Tolerance policy: float32 on both sides, so final-position logits must agree to LOGIT_TOL (measured max abs
diff about 5e-6 on logits of magnitude ~6; the tolerance leaves 10x for other CPUs' kernels), and greedy
generation must be token-identical.
"""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom.model.loader import load_model

LOGIT_TOL = 5e-5
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


@pytest.mark.parametrize("kind", ["llama_tied_gqa", "qwen3"])
def test_greedy_generation_with_tiny_chunks_and_blocks_matches_transformers(kind, tiny_models, make_core, prompts):
    """A 7-token step budget and 4-token blocks: prompts are prefilled over many steps through the paged
    cache, some chunks are a single token, and decodes share steps with other prompts' chunks."""
    _, hf = tiny_models(kind)
    core = make_core(kind, block_size=4, max_num_batched_tokens=7, long_prefill_token_threshold=5)
    got = helpers.generate_tokens(core, prompts, helpers.greedy_params(32))
    for prompt, tokens in zip(prompts, got):
        assert tokens == helpers.hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens"


def test_prompt_logprobs_with_chunked_prefill_match_transformers(tiny_models, make_core, prompts):
    from tokenloom.core.sampling_params import SamplingParams
    _, hf = tiny_models("llama")
    core = make_core("llama", block_size=4, max_num_batched_tokens=9, long_prefill_token_threshold=6)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    for i, p in enumerate(prompts):
        core.add_request(helpers.make_request(f"r{i}", p, params))
    got = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    for i, p in enumerate(prompts):
        entries = got[f"r{i}"]
        assert len(entries) == len(p) and entries[0] is None
        if len(p) == 1:
            continue
        ref = helpers.hf_log_softmax(hf, p)
        for pos in range(1, len(p)):
            chosen = entries[pos][0]  # [token_id, logprob, rank], the prompt token first
            assert int(chosen[0]) == p[pos]
            assert abs(chosen[1] - ref[pos - 1, p[pos]].item()) < LOGIT_TOL
            assert int(chosen[2]) == int((ref[pos - 1] > ref[pos - 1, p[pos]]).sum()) + 1
