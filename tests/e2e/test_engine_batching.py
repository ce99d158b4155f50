"""Continuous batching on the embedded model, through the offline LLM API.

Tolerance policy: token-identical. The reference for each prompt is the same engine running it alone
(max_num_seqs=1, no prefix cache); running all prompts concurrently, with a tiny chunked-prefill budget, or
with a KV cache so small that requests get preempted must give exactly the same greedy tokens. On a mismatch
the failure says, for both outputs, whether each token is the argmax of the model's logits for the sequence
computed alone (helpers.greedy_mismatch) and by what logit gap, so a numerical near-tie is told apart from a
bug. test_reference_embedded.py ties the model itself to transformers.
"""
from __future__ import annotations

import helpers
import pytest

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.input_processor import RequestValidationError

NEW_TOKENS = 16

TEXTS = [
    "Hi",
    "The capital of France is",
    "List three primary colors:",
    "def add(a, b):\n    return",
    "Water boils at",
    "In 1492, Columbus",
    "The opposite of hot is",
    "Photosynthesis is the process by which plants",
    "A haiku about the ocean:\n",
    "SELECT name FROM users WHERE",
    "Q: What is 12 times 12?\nA:",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP, which",
    "Once upon a time, in a kingdom far away, there lived a young princess who loved to explore the forests "
    "around the castle. One day, she found a hidden path that led",
    "Dear team,\n\nThank you all for the hard work this quarter. Our results exceeded expectations, and I want "
    "to highlight a few achievements. First,",
    "<|im_start|>user\nGive me a short tip for learning a new language.<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13,",
    "The following is a detailed explanation of how a refrigerator works. A refrigerator moves heat from the "
    "inside of the appliance to the outside using a refrigerant that circulates through a closed loop of "
    "coils. The compressor",
    "import numpy as np\n\n# compute the mean of each column\nx = np.random.rand(10, 3)\n",
]


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def base(make_llm):
    return make_llm(num_blocks=256)


@pytest.fixture(scope="module")
def prompts(base):
    ids = [base.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len(ids) >= 16 and min(map(len, ids)) == 1 and max(map(len, ids)) >= 40
    return ids


@pytest.fixture(scope="module")
def alone(make_llm, prompts):
    """Each prompt by itself: one running request at a time, nothing cached."""
    llm = make_llm(num_blocks=256, max_num_seqs=1, enable_prefix_caching=False)
    out = tokens(llm.generate(prompts, greedy(), use_tqdm=False))
    assert all(len(t) == NEW_TOKENS for t in out)
    return out


@pytest.fixture(scope="module")
def concurrent(base, prompts):
    """All prompts at once, default budget and block size, prefix caching on."""
    return tokens(base.generate(prompts, greedy(), use_tqdm=False))


def assert_same_as_alone(model, prompts, got, alone):
    for prompt, ours, ref in zip(prompts, got, alone):
        if ours != ref:
            pytest.fail(f"batched: {helpers.greedy_mismatch(model, prompt, ours) or 'greedy'}; "
                        f"alone: {helpers.greedy_mismatch(model, prompt, ref) or 'greedy'}")


# ---- batching ---------------------------------------------------------------------------------------
def test_concurrent_prompts_give_the_same_greedy_outputs_as_each_alone(embedded_loaded, base, prompts, alone,
                                                                       concurrent):
    assert_same_as_alone(embedded_loaded.model, prompts, concurrent, alone)
    assert base.engine.stats()["kv_blocks_used"] == 0


def test_tiny_chunked_prefill_budget_gives_the_same_greedy_outputs(embedded_loaded, make_llm, prompts, alone):
    llm = make_llm(num_blocks=256, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    got = tokens(llm.generate(prompts, greedy(), use_tqdm=False))
    assert_same_as_alone(embedded_loaded.model, prompts, got, alone)
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_kv_cache_too_small_for_all_forces_preemption_and_gives_the_same_outputs(embedded_loaded, make_llm,
                                                                                 prompts, alone):
    num_blocks = 30
    assert sum(-(-len(p) // 16) for p in prompts) < num_blocks < sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts)
    llm = make_llm(num_blocks=num_blocks, block_size=16, enable_prefix_caching=False)
    got = tokens(llm.generate(prompts, greedy(), use_tqdm=False))
    assert llm.engine.stats()["num_preemptions"] > 0
    assert_same_as_alone(embedded_loaded.model, prompts, got, alone)
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_prompts_served_from_the_prefix_cache_give_the_same_outputs(make_llm):
    """Conversations sharing a long system prompt: the second run is served mostly from the prefix cache
    (including a prompt that is a prefix of another) and must not change a token."""
    system = ("<|im_start|>system\nYou are a helpful assistant for a travel agency. Answer briefly and "
              "accurately, in plain English, and say so when you do not know something. Never make up "
              "prices or opening hours.<|im_end|>\n")
    questions = ["What is the capital of Italy?", "Name a prime number.", "Why is the sky blue?"]
    texts = [f"{system}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in questions] + [system]
    uncached_llm = make_llm(num_blocks=128, block_size=16, enable_prefix_caching=False)
    ids = [uncached_llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert len(ids[-1]) >= 32
    uncached = tokens(uncached_llm.generate(ids, greedy(8), use_tqdm=False))
    llm = make_llm(num_blocks=128, block_size=16, enable_prefix_caching=True)
    first = llm.generate(ids, greedy(8), use_tqdm=False)
    second = llm.generate(ids, greedy(8), use_tqdm=False)
    assert tokens(first) == uncached and tokens(second) == uncached
    assert all(o.num_cached_tokens >= 16 * ((len(p) - 1) // 16) for o, p in zip(second, ids))
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_generate_priority_argument_runs_lower_values_first(make_llm, prompts):
    llm = make_llm(num_blocks=64, max_num_seqs=1)
    outs = llm.generate(prompts[:4], greedy(2), priority=[3, 0, 2, 1], use_tqdm=False)
    started = sorted(range(4), key=lambda i: outs[i].metrics["first_scheduled_time"])
    assert started == [1, 3, 2, 0]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 4  # results still come back in input order


# ---- sampling in a mixed batch -------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(base, prompts, concurrent):
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True)
    seeded, other_seed = SamplingParams(seed=1234, **sampled), SamplingParams(seed=99, **sampled)  # only the seed
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = tokens(base.generate([prompts[3]], seeded, use_tqdm=False))[0]
    mixed = tokens(base.generate([prompts[5], prompts[3], prompts[12], prompts[3], prompts[3]],
                                 [unseeded, seeded, greedy(8), seeded, other_seed], use_tqdm=False))
    assert mixed[1] == alone and mixed[3] == alone
    assert mixed[4] != alone  # the same prompt with another seed draws differently (here, and almost surely)
    assert mixed[2] == concurrent[12][:8]  # greedy rows are untouched by the sampled ones


def test_n_returns_n_completions_of_one_shared_prompt_computation(base, prompts):
    prompt = prompts[12]
    before = base.engine.stats()["batched_tokens"]
    (out,) = base.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.prompt_token_ids == prompt
    computed = base.engine.stats()["batched_tokens"] - before
    assert computed <= len(prompt) + 3 * 7  # the prompt once (or less, if cached), then 3 decodes per step


def test_best_of_returns_the_n_completions_with_the_highest_cumulative_logprob(base, prompts):
    params = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (all_four,) = base.generate([prompts[1]], SamplingParams(n=4, logprobs=0, **params), use_tqdm=False)
    (best,) = base.generate([prompts[1]], SamplingParams(n=2, best_of=4, **params), use_tqdm=False)
    ranked = sorted(all_four.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({c.cumulative_logprob for c in ranked}) == 4
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])


# ---- stop strings -----------------------------------------------------------------------------------------
def _boundary_stop(llm, token_ids: list[int]) -> tuple[str, str]:
    """A stop string that spans a token boundary in this output, and the text before it."""
    text = llm.tokenizer.decode(token_ids)
    for k in range(2, len(token_ids) - 2):
        before = llm.tokenizer.decode(token_ids[:k])
        piece_before = before[-2:]
        after = llm.tokenizer.decode(token_ids[: k + 1])[len(before):][:2]
        stop = piece_before + after
        if (len(piece_before) == 2 and len(after) == 2 and text.startswith(before)
                and text.find(stop) == len(before) - 2):
            return stop, text[: len(before) - 2]
    raise AssertionError("no token boundary with 2+ characters on both sides")


def test_stop_string_spanning_a_token_boundary_ends_the_output_before_it(base, prompts, concurrent):
    full = concurrent[12]
    stop, expected = _boundary_stop(base, full)
    out = base.generate([prompts[12]], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == expected
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(full)
    kept = base.generate([prompts[12]], greedy(stop=[stop], include_stop_str_in_output=True),
                         use_tqdm=False)[0].outputs[0]
    assert kept.text == expected + stop
    assert base.engine.stats()["kv_blocks_used"] == 0 and not base.engine.has_unfinished_requests()


# ---- request validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, param, code", [
    ("", greedy(), "prompt", None),
    ([[]], greedy(), "prompt", None),
    ([[1, 2, 49152]], greedy(), "prompt", None),
    ([[1, -1, 2]], greedy(), "prompt", None),
    ("Hello", SamplingParams(stop=[f"s{i}" for i in range(17)]), "stop", None),
    ("Hello", SamplingParams(stop=["x" * 257]), "stop", None),
], ids=["empty-text", "empty-ids", "id-at-vocab-size", "negative-id", "17-stop-sequences", "stop-too-long"])
def test_invalid_request_raises_a_validation_error(base, prompt, params, param, code):
    with pytest.raises(RequestValidationError) as err:
        base.generate(prompt, params, use_tqdm=False)
    assert err.value.param == param and err.value.code == code
    assert not base.engine.has_unfinished_requests()


def test_prompt_longer_than_max_model_len_is_context_length_exceeded(make_llm):
    llm = make_llm(num_blocks=64, max_model_len=64)
    with pytest.raises(RequestValidationError) as err:
        llm.generate([list(range(100, 200))], greedy(), use_tqdm=False)
    assert err.value.code == "context_length_exceeded"
    assert "64" in err.value.message and "100" in err.value.message


def test_prompt_plus_min_tokens_over_max_model_len_is_context_length_exceeded(make_llm):
    llm = make_llm(num_blocks=64, max_model_len=64)
    with pytest.raises(RequestValidationError) as err:
        llm.generate([list(range(100, 150))], greedy(20, min_tokens=15), use_tqdm=False)
    assert (err.value.param, err.value.code) == ("min_tokens", "context_length_exceeded")


def test_max_tokens_is_clamped_to_the_room_the_context_leaves(make_llm):
    llm = make_llm(num_blocks=64, max_model_len=64)
    (out,) = llm.generate([list(range(100, 160))], greedy(100), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_a_batch_with_one_invalid_prompt_adds_nothing(base, prompts):
    with pytest.raises(RequestValidationError):
        base.generate([prompts[0], [], prompts[1]], greedy(), use_tqdm=False)
    assert not base.engine.has_unfinished_requests()


def test_invalid_request_does_not_disturb_requests_in_flight(base, prompts, concurrent):
    stream = base.generate_stream(prompts[:4], greedy())
    finished = {}
    for _ in range(6):
        out = next(stream)
        if out.finished:
            finished[out.request_id] = out
    with pytest.raises(RequestValidationError):
        base.generate([[1, 2, 10**6]], greedy(), use_tqdm=False)
    for out in stream:
        if out.finished:
            finished[out.request_id] = out
    got = [o.outputs[0].token_ids for o in sorted(finished.values(), key=lambda o: int(o.request_id))]
    assert got == concurrent[:4]
