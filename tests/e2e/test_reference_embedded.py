"""The embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same GGUF file.

Tolerance policy: both sides dequantize the same file to float32 and run float32 math, so they differ only
by floating-point summation order. Measured: final-position logits (magnitude up to ~35) differ by at most
~6e-5, logprobs by about as much. Tolerances are set a few times above that; greedy tokens must be identical.
"""
from __future__ import annotations

import helpers
import pytest

from tokenloom.core.sampling_params import SamplingParams

LOGIT_TOL = 3e-4
LOGPROB_TOL = 3e-4
NEW_TOKENS = 32

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Hi",
    "Translate to French: I like apples. ->",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def prompts(llm):
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids), "prompts should all have different lengths"
    return ids


@pytest.fixture(scope="module")
def outputs(llm, prompts):
    """One concurrent greedy run of all prompts, with logprobs and prompt logprobs (a decode step re-reads all
    weights on CPU, so the tests below share this run)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    return llm.generate(prompts, params, use_tqdm=False)


def test_final_logits_match_transformers_in_one_flat_batch(embedded_loaded, hf_embedded, prompts):
    got = helpers.last_logits(embedded_loaded.model, prompts)
    want = helpers.hf_last_logits(hf_embedded, prompts)
    diff = (got - want).abs().max().item()
    print(f"embedded model: max abs logit diff {diff:.2e} (logits up to {want.abs().max().item():.1f})")
    assert diff < LOGIT_TOL


def test_greedy_generation_matches_transformers_token_for_token(hf_embedded, prompts, outputs):
    """Our 8 prompts run concurrently (one flat batch per step); transformers generates them as one left-padded
    batch (checked to give the same tokens as one generate() call per prompt, at a third of the cost)."""
    reference = helpers.hf_greedy_batch(hf_embedded, prompts, NEW_TOKENS)
    for prompt, out, want in zip(prompts, outputs, reference):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == NEW_TOKENS
        assert out.outputs[0].finish_reason == "length"
        assert tokens == want, helpers.describe_divergence(hf_embedded, prompt, tokens, want)


def test_logprobs_of_chosen_and_top_tokens_match_transformers_log_softmax(hf_embedded, prompts, outputs):
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        ref = helpers.hf_log_softmax(hf_embedded, prompt + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        cumulative = 0.0
        for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert token == int(row.argmax())  # greedy: the chosen token is transformers' top token
            assert entries[token].rank == 1
            top = row.topk(5)
            assert set(entries) == set(top.indices.tolist())  # chosen token + top 5, greedy: same set
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                worst = max(worst, abs(entries[tid].logprob - lp))
            cumulative += entries[token].logprob
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)
    print(f"max abs logprob diff {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_prompt_logprobs_match_transformers_log_softmax(hf_embedded, prompts, outputs):
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        ref = helpers.hf_log_softmax(hf_embedded, prompt)
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entries, row, token = out.prompt_logprobs[pos], ref[pos - 1], prompt[pos]
            assert token in entries
            worst = max(worst, abs(entries[token].logprob - row[token].item()))
            assert entries[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(5)
            assert set(top.indices.tolist()) <= set(entries)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                worst = max(worst, abs(entries[tid].logprob - lp))
    print(f"max abs prompt logprob diff {worst:.2e}")
    assert worst < LOGPROB_TOL
