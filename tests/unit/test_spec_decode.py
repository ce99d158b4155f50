"""Speculative decoding on a tiny random Llama: the n-gram proposer, the verification rules, and the engine
with speculation against the same engine without it (same weights, same requests)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import generate_tokens, greedy_params, make_request, run_to_completion

from tokenloom.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.spec_decode.proposer import NgramProposer
from tokenloom.spec_decode.rejection_sampler import accept_deterministic, rejection_sample

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts: the n-gram proposer finds matches in them from the first decode on.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [11], [20, 21, 22, 23, 24, 25, 26, 27] * 3, [3, 4] * 12]


def chi2_critical(df: int, z: float = 3.090) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation; z = 3.090 is alpha = 0.001."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


# ---- proposer -------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]


def test_ngram_tries_the_longest_ngram_first():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=2))
    # Last 2 tokens (7, 3) occur once, followed by 8; the 1-gram 3 alone last occurred before 6.
    assert p.propose([7, 3, 8, 0, 3, 6, 7, 3], 1) == [8]


def test_ngram_without_a_match_proposes_nothing():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 4, 5], 4) == []


# ---- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "speculative method 'eagle' is not supported"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..16"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
    ({"num_spec_tokens": 3}, "unknown speculative_config key(s): num_spec_tokens"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_a_one_line_error(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_kwargs(speculative_config=value)


def test_speculative_config_from_json_string():
    cfg = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config.num_speculative_tokens == 3


# ---- verification rules -----------------------------------------------------------------------------------
def test_deterministic_rule_accepts_the_matching_prefix():
    assert accept_deterministic([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accept_deterministic([4, 5, 6], [1, 5, 6, 8]) == 0
    assert accept_deterministic([4, 5, 6], [4, 5, 6, 8]) == 3


def test_rejection_sampling_preserves_the_target_distribution():
    """Chi-square goodness of fit of the first emitted token against p, 20,000 draws, alpha = 0.001 (df 4:
    critical 18.47). A draft q far from p makes both accepting and resampling matter; a rule that always
    accepted (or resampled from p) would give chi-square in the thousands."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.05, 0.1, 0.15, 0.2, 0.5]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    draws = 20_000
    for _ in range(draws):
        d = torch.multinomial(q[0], 1, generator=g)
        counts[rejection_sample(p, q, d, generator=g)[0]] += 1
    expected = p[0].float() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(4), (chi2, counts.tolist())


# ---- the engine, speculation on vs off ---------------------------------------------------------------------
def _pair(make_core, **engine_args):
    return make_core(**engine_args), make_core(speculative_config=NGRAM, **engine_args)


def test_greedy_output_identical_with_speculation(make_core):
    off, on = _pair(make_core)
    params = greedy_params(max_tokens=40)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    s = on.stats()
    assert s["spec_num_drafts"] > 0 and s["spec_num_accepted_tokens"] > 0


def test_seeded_sampling_identical_with_speculation(make_core):
    """Each position draws the plain decode's noise, and unused draws are replayed, so seeds reproduce."""
    off, on = _pair(make_core)
    params = [SamplingParams(temperature=0.3, top_k=3, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(PROMPTS))]
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    assert on.stats()["spec_num_accepted_tokens"] > 0


def test_penalties_and_min_tokens_see_the_drafts_before_each_position(make_core):
    off, on = _pair(make_core)
    params = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2,
                            min_tokens=20, seed=3)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(make_core):
    off, on = _pair(make_core)
    params = greedy_params(max_tokens=24, logprobs=2)

    def run(core):
        core.add_request(make_request("a", PROMPTS[0], params))
        out = []
        while core.has_unfinished_requests():
            for o in core.step():
                out.extend(o.new_logprobs or [])
        return out
    got, want = run(on), run(off)
    assert len(got) == len(want) == 24
    for g, w in zip(got, want):
        assert [e[0] for e in g] == [e[0] for e in w]
        assert [e[1] for e in g] == pytest.approx([e[1] for e in w], abs=1e-4)
    assert on.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_is_never_overshot(make_core, max_tokens):
    on = make_core(speculative_config=NGRAM)
    out = generate_tokens(on, PROMPTS, greedy_params(max_tokens=max_tokens))
    assert [len(o) for o in out] == [max_tokens] * len(PROMPTS)


def test_stop_token_ends_the_sequence_at_the_first_one(make_core):
    off, on = _pair(make_core)
    want = generate_tokens(off, PROMPTS[:1], greedy_params(max_tokens=30))[0]
    stop = want[10]
    params = greedy_params(max_tokens=30, stop_token_ids=[stop])
    got = generate_tokens(on, PROMPTS[:1], params)[0]
    assert got == want[:want.index(stop) + 1]


def test_token_budget_counts_draft_tokens(make_core):
    on = make_core(speculative_config=NGRAM, max_num_batched_tokens=8)
    for i, p in enumerate(PROMPTS):
        on.add_request(make_request(f"r{i}", p, greedy_params(max_tokens=20)))
    saw_drafts = False
    while on.has_unfinished_requests():
        on.step()
        assert on.last_step_tokens <= 8
        saw_drafts |= on.scheduler.spec_num_drafts > 0
    assert saw_drafts


def test_blocks_of_rejected_drafts_are_released(make_core):
    on = make_core(speculative_config={**NGRAM, "num_speculative_tokens": 8}, block_size=4)
    bs = on.kv_manager.block_size
    on.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 9], greedy_params(max_tokens=40)))
    while on.has_unfinished_requests():
        on.step()
        for r in on.scheduler.running:
            assert len(r.block_ids) <= -(-r.num_tokens // bs)
    assert on.kv_manager.pool.num_used == 0
    assert on.scheduler.spec_num_draft_tokens > on.scheduler.spec_num_accepted_tokens


def test_disable_by_batch_size_turns_speculation_off_for_large_batches(make_core):
    on = make_core(speculative_config={**NGRAM, "disable_by_batch_size": 2})
    generate_tokens(on, PROMPTS, greedy_params(max_tokens=8))  # 4 running: never speculates
    assert on.scheduler.spec_num_drafts == 0
    generate_tokens(on, PROMPTS[:2], greedy_params(max_tokens=16), prefix="s")
    assert on.scheduler.spec_num_drafts > 0


def test_chunked_prefill_and_prefix_caching_with_speculation(make_core):
    args = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=4)
    off, on = _pair(make_core, **args)
    params = greedy_params(max_tokens=20)
    first = generate_tokens(on, PROMPTS, params)
    again = generate_tokens(on, PROMPTS, params, prefix="again")  # served from the prefix cache
    assert first == again == generate_tokens(off, PROMPTS, params)
    assert on.stats()["prefix_cache_hits"] > 0


def test_preemption_with_speculation(make_core):
    off, on = _pair(make_core, num_blocks=12, block_size=4)
    params = greedy_params(max_tokens=24)
    assert generate_tokens(on, PROMPTS, params) == generate_tokens(off, PROMPTS, params)
    assert on.stats()["num_preemptions"] > 0 and on.stats()["spec_num_drafts"] > 0


def test_n_siblings_speculate_independently(make_core):
    off, on = _pair(make_core)
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)

    def run(core):
        core.add_request(make_request("a", PROMPTS[1], params))
        return run_to_completion(core)
    got, want = run(on), run(off)
    assert got == want and len(got) == 3
    assert on.stats()["spec_num_drafts"] > 0



def test_engine_stats_become_vllm_spec_decode_counters(make_core):
    from prometheus_client import CollectorRegistry, generate_latest

    from tokenloom.bench.serve import SPEC_COUNTERS
    from tokenloom.core.stats import engine_stats
    from tokenloom.engine.core import spec_summary
    from tokenloom.metrics import ServerMetrics
    on = make_core(speculative_config=NGRAM)
    generate_tokens(on, PROMPTS, greedy_params(max_tokens=20))
    stats = on.stats()
    registry = CollectorRegistry()
    metrics = ServerMetrics("m", registry=registry, prefix="tokenloom:")
    metrics.observe_engine_stats(engine_stats(stats))
    text = generate_latest(registry).decode()
    for name in SPEC_COUNTERS:
        key = name.replace("spec_decode_", "spec_")
        assert f'tokenloom:{name}_total{{model_name="m"}} {float(stats[key])}' in text
    assert f'tokenloom:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} ' \
           f'{float(stats["spec_num_accepted_tokens_per_pos"][0])}' in text
    assert stats["spec_num_accepted_tokens_per_pos"][0] >= stats["spec_num_accepted_tokens_per_pos"][-1]
    assert "acceptance rate" in spec_summary(stats) and "mean accepted length" in spec_summary(stats)
