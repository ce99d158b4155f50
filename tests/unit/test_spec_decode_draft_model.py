"""Draft-model speculative decoding on tiny random models: the engine with a draft model against the same
engine without speculation (same weights, same requests). Three drafts with the target's vocabulary: the
target itself (its drafts are what the target would sample, so nearly all are accepted), a perturbed copy
of it (some accepted, some not), and a random model of another family (most rejected, so the residual
resampling carries the outputs)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import build_tiny_model, generate_tokens, greedy_params, make_request, run_to_completion, save_tiny_model

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.sampler import Sampler, SamplingRow
from tokenloom.spec_decode.rejection_sampler import verify_sampled_drafts

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [11], [20, 21, 22, 23, 24, 25, 26, 27] * 3, [3, 4] * 12]


def chi2_critical(df: int, z: float = 3.090) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation; z = 3.090 is alpha = 0.001."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2_homogeneity(a: list, b: list) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of a 2 x C table of category counts."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), len(cats) - 1


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    """Speculative configs: the target ("llama") as its own draft, the target with 5% noise on every weight
    (about a third of its top-2 drafts accepted), and a random Qwen2."""
    near = build_tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    near_folder = save_tiny_model(near, str(tmp_path_factory.mktemp("tiny_llama_near")))

    def config(folder):
        return {"method": "draft_model", "model": folder, "num_speculative_tokens": 4}
    return {"self": config(tiny_models("llama")[0]), "near": config(near_folder),
            "random": config(tiny_models("qwen2")[0])}


def _pair(make_core, draft, **engine_args):
    return make_core(**engine_args), make_core(speculative_config=draft, **engine_args)


# ---- configuration -----------------------------------------------------------------------------------------
def test_draft_model_needs_a_model_path():
    with pytest.raises(ConfigError, match='needs "model"'):
        EngineConfig.from_kwargs(speculative_config={"method": "draft_model"})


def test_draft_model_with_tensor_parallelism_is_a_config_error(drafts):
    with pytest.raises(ConfigError, match="needs tensor_parallel_size 1"):
        EngineConfig.from_kwargs(speculative_config=drafts["self"], tensor_parallel_size=2)


def test_vocabulary_mismatch_is_a_one_line_error_at_start(make_core, tmp_path):
    import transformers
    torch.manual_seed(0)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512)).eval()
    folder = save_tiny_model(other, str(tmp_path / "vocab300"))
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens and the target 512") as err:
        make_core(speculative_config={"method": "draft_model", "model": folder})
    assert "\n" not in str(err.value)


# ---- exactness ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["self", "near", "random"])
def test_greedy_output_identical_with_a_draft_model(make_core, drafts, draft):
    off, on = _pair(make_core, drafts[draft])
    params = greedy_params(max_tokens=16)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    s = on.stats()
    assert s["spec_num_drafts"] > 0
    if draft == "self":
        assert s["spec_num_accepted_tokens"] >= 0.9 * s["spec_num_draft_tokens"]
    else:
        assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]


def test_the_target_as_its_own_draft_accepts_its_sampled_drafts(make_core, drafts):
    """Drafts are drawn from the very distribution the target samples from (same penalties, min_tokens,
    temperature, top-k/p, over the same context), so p = q up to rounding and min(1, p/q) accepts them all:
    a draft processed differently, or one reading wrong KV, would show rejections."""
    on = make_core(speculative_config=drafts["self"])
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3,
                            min_tokens=10, max_tokens=24, seed=5)
    generate_tokens(on, PROMPTS, params)
    s = on.stats()
    assert s["spec_num_draft_tokens"] > 50
    assert s["spec_num_accepted_tokens"] >= 0.99 * s["spec_num_draft_tokens"], s


def test_seeded_sampling_reproduces_itself(make_core, drafts):
    on = make_core(speculative_config=drafts["near"])
    params = [SamplingParams(temperature=1.0, top_k=2, seed=40 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first = generate_tokens(on, PROMPTS, params)
    assert generate_tokens(on, PROMPTS, params, prefix="again") == first
    s = on.stats()
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_sampled_outputs_have_the_distribution_of_speculation_off(make_core, drafts):
    """Chi-square test of homogeneity, speculation off vs on with the perturbed draft: 200 unseeded draws each
    of output tokens 2..4 (the ones drafted; top_k 2, so at most 8 categories), alpha = 0.001 (critical value
    by Wilson-Hilferty). About a third of the drafts are accepted, so acceptance and residual resampling
    both shape the outputs. ~1 minute on 2 busy cores, hence slow; the verifier's own statistical test
    (test_verifier_keeps_the_processed_target_distribution) is fast."""
    off, on = _pair(make_core, drafts["near"])
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True)
    draws = 200
    a = [tuple(t[1:]) for t in generate_tokens(off, [PROMPTS[3]] * draws, params)]
    b = [tuple(t[1:]) for t in generate_tokens(on, [PROMPTS[3]] * draws, params)]
    s = on.stats()
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"] > 0
    chi2, df = chi2_homogeneity(a, b)
    assert chi2 < chi2_critical(df), (chi2, df)


def test_verifier_keeps_the_processed_target_distribution():
    """The verifier on synthetic logits: a target processed by temperature 0.7 and top-k 3, and a draft that
    only ever proposes token 4 (outside the top 3, so always rejected). Chi-square goodness of fit of the
    emitted token against softmax(processed logits), 500 draws, alpha = 0.001 (df 2). Verifying against the
    unprocessed target would emit tokens 3 and 4 and flatten the rest."""
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=4)
    rows = [(0, SamplingRow(params, [1], []), None), (1, SamplingRow(params, [1], [4]), None)]
    q = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    p = torch.softmax(torch.tensor([2.0, 1.5, 1.0]) / 0.7, 0)
    counts = torch.zeros(5)
    draws = 500
    for _ in range(draws):
        tokens, _ = verify_sampled_drafts(Sampler(), logits, rows, [4], q, g)
        assert len(tokens) == 1
        counts[tokens[0]] += 1
    assert counts[3:].sum() == 0
    expected = p * draws
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(2), (chi2, counts.tolist())


def test_logprobs_of_sampled_tokens_are_the_targets(make_core, drafts):
    """Each emitted token's logprob is the target's for that token in its context: the same as the prompt
    logprobs of the whole output fed back to the engine without speculation."""
    off, on = _pair(make_core, drafts["near"])
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True, logprobs=1)
    on.add_request(make_request("a", PROMPTS[0], params))
    tokens, logprobs = [], []
    while on.has_unfinished_requests():
        for o in on.step():
            tokens.extend(o.new_token_ids)
            logprobs.extend(o.new_logprobs or [])
    assert len(tokens) == len(logprobs) == 16
    off.add_request(make_request("b", PROMPTS[0] + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    want = []
    while off.has_unfinished_requests():
        for o in off.step():
            want = want or (o.prompt_logprobs or [])
    want = want[len(PROMPTS[0]):]
    assert [e[0][0] for e in logprobs] == tokens == [w[0][0] for w in want]
    assert [e[0][1] for e in logprobs] == pytest.approx([w[0][1] for w in want], abs=1e-4)


def test_greedy_logprobs_equal_those_without_speculation(make_core, drafts):
    off, on = _pair(make_core, drafts["near"])
    params = greedy_params(max_tokens=16, logprobs=2)

    def run(core):
        core.add_request(make_request("a", PROMPTS[1], params))
        out = []
        while core.has_unfinished_requests():
            for o in core.step():
                out.extend(o.new_logprobs or [])
        return out
    got, want = run(on), run(off)
    assert len(got) == len(want) == 16
    for g, w in zip(got, want):
        assert [e[0] for e in g] == [e[0] for e in w]
        assert [e[1] for e in g] == pytest.approx([e[1] for e in w], abs=1e-4)


# ---- request features -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_is_never_overshot(make_core, drafts, max_tokens):
    on = make_core(speculative_config=drafts["self"])
    out = generate_tokens(on, PROMPTS, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
    assert [len(o) for o in out] == [max_tokens] * len(PROMPTS)


def test_stop_token_ends_the_sequence_at_the_first_one(make_core, drafts):
    off, on = _pair(make_core, drafts["self"])
    want = generate_tokens(off, PROMPTS[:1], greedy_params(max_tokens=24))[0]
    stop = want[10]
    got = generate_tokens(on, PROMPTS[:1], greedy_params(max_tokens=24, stop_token_ids=[stop]))[0]
    assert got == want[:want.index(stop) + 1]


def test_penalties_and_min_tokens_with_a_draft_model(make_core, drafts):
    off, on = _pair(make_core, drafts["near"])
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.2,
                            min_tokens=12)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    assert on.stats()["spec_num_drafts"] > 0


def test_n_siblings_draft_and_reproduce(make_core, drafts):
    on = make_core(speculative_config=drafts["near"])
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)

    def run(rid):
        on.add_request(make_request(rid, PROMPTS[1], params))
        return [tokens for (_, index), tokens in sorted(run_to_completion(on).items())]
    first = run("a")
    assert run("b") == first
    assert len(first) == 3 and len(set(map(tuple, first))) == 3 and all(len(t) == 16 for t in first)
    assert on.stats()["spec_num_drafts"] > 0


def test_chunked_prefill_and_prefix_caching_with_a_draft_model(make_core, drafts):
    """Prompts prefilled in chunks, then again from the prefix cache: the draft reads its own KV of the cached
    blocks (the target as its own draft keeps accepting nearly everything)."""
    args = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=4)
    off, on = _pair(make_core, drafts["self"], **args)
    params = greedy_params(max_tokens=16)
    first = generate_tokens(on, PROMPTS, params)
    before = on.stats()
    again = generate_tokens(on, PROMPTS, params, prefix="again")
    assert first == again == generate_tokens(off, PROMPTS, params)
    s = on.stats()
    assert s["prefix_cache_hits"] > before["prefix_cache_hits"]
    accepted = s["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert accepted >= 0.9 * (s["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]) > 0


def test_preemption_with_a_draft_model(make_core, drafts):
    off, on = _pair(make_core, drafts["near"], num_blocks=14, block_size=4)
    params = greedy_params(max_tokens=16)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    assert on.stats()["num_preemptions"] > 0 and on.stats()["spec_num_drafts"] > 0


def test_disable_by_batch_size_pauses_the_draft_model(make_core, drafts):
    """No drafting while more than 2 requests run, not even in the step that admits them."""
    on = make_core(speculative_config={**drafts["self"], "disable_by_batch_size": 2})
    for i, p in enumerate(PROMPTS):
        on.add_request(make_request(f"r{i}", p, greedy_params(max_tokens=8)))
    while on.has_unfinished_requests():
        on.step()
        assert not any(on.scheduler.worker_drafts.values())
    assert on.scheduler.spec_num_drafts == 0
    generate_tokens(on, PROMPTS[:2], greedy_params(max_tokens=16), prefix="s")
    assert on.scheduler.spec_num_drafts > 0
