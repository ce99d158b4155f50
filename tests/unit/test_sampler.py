"""Specification of the batched sampler, each behaviour checked against an independent
computation on fixed logits.

To observe what a stage did, rows ask for `logprobs=V, logprobs_mode="processed"`: the
returned top-V logprobs are then the whole processed distribution (-inf = masked).
"""
from __future__ import annotations

import math

import pytest
import torch

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.sampler import Sampler, SamplingRow, compute_prompt_logprobs

V = 12
# Fixed, distinct logits with both signs.
LOGITS = torch.tensor([1.5, -0.5, 3.0, 0.2, -2.0, 2.2, 0.9, -1.1, 0.0, 1.1, -0.3, 2.6])
EOS = 2  # the argmax of LOGITS
SECOND = 11  # the second largest

sampler = Sampler()


def row(prompt=(), output=(), generator=None, bad_words=(), eos=(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), generator,
                       [list(b) for b in bad_words], list(eos))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).repeat(n, 1)


def processed(logits=LOGITS, **kw) -> torch.Tensor:
    """The processed log-distribution [V] (indexed by token id) of one row."""
    kw.setdefault("temperature", 1.0)
    out = sampler(logits.unsqueeze(0).clone(),
                  [row(logprobs=V, logprobs_mode="processed", **kw)])
    lp = torch.empty(V)
    lp[out.logprob_token_ids[0, 1:]] = out.logprobs[0, 1:]
    return lp


def kept(lp: torch.Tensor) -> set[int]:
    return {i for i in range(V) if lp[i] > -math.inf}


def assert_same_distribution(lp: torch.Tensor, expected_logits: torch.Tensor):
    torch.testing.assert_close(lp, torch.log_softmax(expected_logits, -1))


# ------------------------------------------------------------------ greedy


def test_temperature_zero_takes_the_argmax():
    logits = torch.randn(5, 50, generator=seeded(0))
    out = sampler(logits, [row(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(4, 50, generator=seeded(1))
    out = sampler(logits, [row(temperature=1.5, top_k=1) for _ in range(4)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_batch_consumes_no_random_numbers():
    g = seeded(3)
    g_state, global_state = g.get_state(), torch.get_rng_state()
    sampler(batch(LOGITS, 3), [row(temperature=0.0, seed=3, generator=g),
                               row(temperature=0.0), row(top_k=1)])
    assert torch.equal(g.get_state(), g_state)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_all_greedy_batch_without_logprobs_returns_no_logprobs():
    out = sampler(batch(LOGITS, 2), [row(temperature=0.0), row(temperature=0.0)])
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None


def test_greedy_rows_are_identical_with_or_without_sampled_rows_in_the_batch():
    logits = torch.randn(6, 40, generator=seeded(4))
    greedy_params = dict(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 2.0})
    alone = sampler(logits[[0, 3]].clone(), [row(output=[1, 2], **greedy_params),
                                             row(output=[5], **greedy_params)])
    mixed_rows = [row(output=[1, 2], **greedy_params), row(temperature=0.8, top_p=0.5),
                  row(temperature=1.3, top_k=3, seed=1, generator=seeded(1)),
                  row(output=[5], **greedy_params), row(min_p=0.2, presence_penalty=1.0),
                  row(temperature=0.5)]
    mixed = sampler(logits.clone(), mixed_rows)
    assert mixed.token_ids[[0, 3]].tolist() == alone.token_ids.tolist()


def test_input_logits_are_not_modified():
    logits = batch(LOGITS, 3)
    before = logits.clone()
    sampler(logits, [row(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, logit_bias={1: 5.0},
                         repetition_penalty=2.0, prompt=[0, 1], output=[3]),
                     row(temperature=0.0, allowed_token_ids=[1, 2]),
                     row(bad_words=[[2]], output=[1])])
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ transforms


def test_temperature_divides_the_logits():
    assert_same_distribution(processed(temperature=0.5), LOGITS / 0.5)


def test_top_k_keeps_exactly_the_k_largest_logits():
    for k in (2, 3, 7, V - 1):
        lp = processed(top_k=k)
        expected = set(LOGITS.topk(k).indices.tolist())
        assert kept(lp) == expected
        masked = torch.full((V,), -math.inf)
        masked[list(expected)] = LOGITS[list(expected)]
        assert_same_distribution(lp, masked)


def test_top_k_larger_than_vocab_keeps_everything():
    assert kept(processed(top_k=10 * V)) == set(range(V))


def _nucleus(probs: list[float], p: float) -> set[int]:
    """Smallest set of most likely tokens whose total probability is >= p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    chosen, total = set(), 0.0
    for i in order:
        chosen.add(i)
        total += probs[i]
        if total >= p:
            break
    return chosen


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.75, 0.9, 0.99])
def test_top_p_keeps_exactly_the_nucleus(p):
    probs = torch.softmax(LOGITS, -1).tolist()
    lp = processed(top_p=p)
    nucleus = _nucleus(probs, p)
    assert kept(lp) == nucleus
    masked = torch.full((V,), -math.inf)
    masked[list(nucleus)] = LOGITS[list(nucleus)]
    assert_same_distribution(lp, masked)


def test_top_p_applies_after_temperature_and_top_k():
    T, k, p = 0.7, 6, 0.6
    top = LOGITS.topk(k).indices.tolist()
    masked = torch.full((V,), -math.inf)
    masked[top] = LOGITS[top] / T
    nucleus = _nucleus(torch.softmax(masked, -1).tolist(), p)
    assert kept(processed(temperature=T, top_k=k, top_p=p)) == nucleus


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 0.9])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p):
    probs = torch.softmax(LOGITS, -1)
    expected = {i for i in range(V) if probs[i] >= min_p * probs.max()}
    assert kept(processed(min_p=min_p)) == expected


def test_logit_bias_adds_to_the_logits():
    bias = {1: 4.0, 4: -3.5, 9: 100.0}
    expected = LOGITS.clone()
    for t, b in bias.items():
        expected[t] += b
    assert_same_distribution(processed(logit_bias=bias), expected)


def test_logit_bias_can_force_a_greedy_choice():
    out = sampler(batch(LOGITS, 1), [row(temperature=0.0, logit_bias={4: 100.0})])
    assert out.token_ids.tolist() == [4]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    prompt, output, r = [0, 1], [5, 7, 5], 2.0  # 0, 5 positive; 1, 7 negative
    expected = LOGITS.clone()
    for t in {0, 1, 5, 7}:
        expected[t] = expected[t] / r if expected[t] > 0 else expected[t] * r
    lp = processed(prompt=prompt, output=output, repetition_penalty=r)
    assert_same_distribution(lp, expected)


def test_frequency_penalty_subtracts_per_occurrence_in_the_output_only():
    prompt, output, f = [3, 9], [0, 0, 0, 6], 0.5
    expected = LOGITS.clone()
    expected[0] -= 3 * f
    expected[6] -= 1 * f
    assert_same_distribution(processed(prompt=prompt, output=output, frequency_penalty=f),
                             expected)


def test_presence_penalty_subtracts_once_per_token_present_in_the_output_only():
    prompt, output, pp = [3, 9], [0, 0, 0, 6], 1.5
    expected = LOGITS.clone()
    expected[0] -= pp
    expected[6] -= pp
    assert_same_distribution(processed(prompt=prompt, output=output, presence_penalty=pp),
                             expected)


def test_negative_presence_and_frequency_penalties_encourage_repetition():
    output = [4, 4]
    expected = LOGITS.clone()
    expected[4] += 2 * 1.0 + 0.5
    lp = processed(output=output, frequency_penalty=-1.0, presence_penalty=-0.5)
    assert_same_distribution(lp, expected)


def test_penalties_apply_only_to_the_rows_that_ask_for_them():
    logits = batch(LOGITS, 2)
    out = sampler(logits, [row(output=[EOS], presence_penalty=2.0, frequency_penalty=2.0,
                               temperature=0.0),
                           row(output=[EOS], temperature=0.0)])
    assert out.token_ids.tolist() == [SECOND, EOS]


def test_penalties_follow_the_bias():
    # HF/vLLM order: bias first, then the repetition penalty divides the biased logit.
    expected = LOGITS.clone()
    expected[3] = (expected[3] + 1.8) / 2.0
    lp = processed(output=[3], logit_bias={3: 1.8}, repetition_penalty=2.0)
    assert_same_distribution(lp, expected)


# ------------------------------------------------------------------ masks


def test_allowed_token_ids_mask_everything_else():
    allowed = [1, 4, 7]
    lp = processed(allowed_token_ids=allowed)
    masked = torch.full((V,), -math.inf)
    masked[allowed] = LOGITS[allowed]
    assert_same_distribution(lp, masked)


def test_allowed_token_ids_restrict_the_greedy_choice():
    out = sampler(batch(LOGITS, 1), [row(temperature=0.0, allowed_token_ids=[1, 4, 7])])
    assert out.token_ids.tolist() == [1]  # the largest of LOGITS[[1, 4, 7]]


def test_single_token_bad_word_is_always_banned():
    lp = processed(bad_words=[[EOS], [4]])
    assert kept(lp) == set(range(V)) - {EOS, 4}


def test_multi_token_bad_word_bans_its_last_token_after_its_prefix():
    lp = processed(bad_words=[[6, 8, EOS]], output=[1, 6, 8])
    assert kept(lp) == set(range(V)) - {EOS}


def test_multi_token_bad_word_does_not_ban_when_the_prefix_does_not_match():
    assert kept(processed(bad_words=[[6, 8, EOS]], output=[6, 1])) == set(range(V))
    assert kept(processed(bad_words=[[6, 8, EOS]], output=[8, 6])) == set(range(V))
    assert kept(processed(bad_words=[[6, 8, EOS]], output=[8])) == set(range(V))


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    eos, stop_id = EOS, SECOND  # the two largest logits
    third = LOGITS.topk(3).indices[2].item()
    p = dict(temperature=0.0, min_tokens=2, stop_token_ids=[stop_id], eos=[eos])
    out = sampler(batch(LOGITS, 2), [row(output=[], **p), row(output=[0], **p)])
    assert out.token_ids.tolist() == [third, third]


def test_min_tokens_stops_suppressing_once_reached():
    p = dict(temperature=0.0, min_tokens=2, stop_token_ids=[SECOND], eos=[EOS])
    out = sampler(batch(LOGITS, 1), [row(output=[0, 0], **p)])
    assert out.token_ids.tolist() == [EOS]
    lp = processed(output=[0, 0], min_tokens=2, stop_token_ids=[SECOND], eos=[EOS])
    assert kept(lp) == set(range(V))


def test_min_tokens_with_ignore_eos_suppresses_only_the_stop_token_ids():
    lp = processed(output=[], min_tokens=2, stop_token_ids=[SECOND], eos=[EOS], ignore_eos=True)
    assert kept(lp) == set(range(V)) - {SECOND}


# ------------------------------------------------------------------ random draws


def test_sampled_tokens_follow_softmax_of_logits_over_temperature():
    torch.manual_seed(1234)
    n, T = 40_000, 0.8
    logits = LOGITS[:6].clone()
    out = sampler(batch(logits, n), [row(temperature=T) for _ in range(n)])
    freq = torch.bincount(out.token_ids, minlength=6).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits / T, -1), atol=0.01, rtol=0)


def test_seeded_row_draws_follow_the_distribution():
    g = seeded(99)
    logits = LOGITS[:4].clone() / 2
    n = 3000
    tokens = [sampler(logits[None].clone(), [row(seed=99, generator=g)]).token_ids.item()
              for _ in range(n)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits, -1), atol=0.03, rtol=0)


def test_sampled_tokens_stay_within_top_k_top_p_support():
    torch.manual_seed(5)
    n = 5000
    out = sampler(batch(LOGITS, n), [row(top_k=5, top_p=0.7) for _ in range(n)])
    support = kept(processed(top_k=5, top_p=0.7))
    assert set(out.token_ids.tolist()) == support


def _steps(rows_fn, position: int, steps: int = 8, vocab: int = 64) -> list[int]:
    """Run `steps` steps; return the tokens of the row at `position`."""
    logits_gen = seeded(2024)
    tokens = []
    for _ in range(steps):
        rows = rows_fn()
        logits = torch.randn(len(rows), vocab, generator=logits_gen)
        logits[position] = torch.linspace(-1, 1, vocab)  # the tracked row's logits
        tokens.append(sampler(logits, rows).token_ids[position].item())
    return tokens


def test_seeded_row_gives_the_same_tokens_alone_and_in_a_mixed_batch():
    p = dict(temperature=1.5, top_p=0.95, seed=42)
    g_alone, g_mixed, g_other = seeded(42), seeded(42), seeded(7)
    alone = _steps(lambda: [row(generator=g_alone, **p)], position=0)
    mixed = _steps(lambda: [row(temperature=0.0), row(temperature=1.0),
                            row(temperature=0.9, seed=7, generator=g_other),
                            row(generator=g_mixed, **p), row(top_k=3)], position=3)
    assert alone == mixed
    assert len(set(alone)) > 1  # really random


def test_different_seeds_give_different_tokens():
    g1, g2 = seeded(1), seeded(2)
    a = _steps(lambda: [row(temperature=2.0, seed=1, generator=g1)], 0, steps=10)
    b = _steps(lambda: [row(temperature=2.0, seed=2, generator=g2)], 0, steps=10)
    assert a != b


def test_all_seeded_batch_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    sampler(batch(LOGITS, 2), [row(seed=1, generator=seeded(1)), row(seed=2, generator=seeded(2))])
    assert torch.equal(torch.get_rng_state(), state)


def test_top_k_only_and_plain_rows_never_sort_the_vocabulary(monkeypatch):
    def no_sort(*a, **k):
        raise AssertionError("full sort")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    out = sampler(batch(LOGITS, 3), [row(top_k=3), row(), row(min_p=0.1)])
    assert out.token_ids.shape == (3,)


# ------------------------------------------------------------------ logprobs


def test_raw_logprobs_are_log_softmax_of_the_model_logits():
    logits = torch.randn(3, 30, generator=seeded(8))
    rows = [row(logprobs=4, temperature=0.6, top_k=5, logit_bias={0: 3.0}),
            row(logprobs=4, temperature=0.0, repetition_penalty=1.5, output=[1]),
            row(logprobs=4, min_p=0.3)]
    out = sampler(logits.clone(), rows)
    raw = torch.log_softmax(logits, -1)
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.token_ids[:, None])[:, 0])
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    assert out.logprobs.dtype == torch.float32


def test_rank_is_one_plus_the_number_of_more_likely_tokens():
    logits = torch.randn(50, 30, generator=seeded(9))
    out = sampler(logits.clone(), [row(logprobs=0, temperature=3.0) for _ in range(50)])
    raw = torch.log_softmax(logits, -1)
    for b in range(50):
        chosen = out.token_ids[b].item()
        expected = 1 + sum(1 for v in raw[b] if v > raw[b, chosen])
        assert out.ranks[b].item() == expected
    assert out.logprob_token_ids.shape == (50, 1)


def test_greedy_choice_has_rank_one():
    out = sampler(batch(LOGITS, 1), [row(temperature=0.0, logprobs=2)])
    assert out.ranks.tolist() == [1]


def test_logprob_width_is_the_largest_request_in_the_batch():
    out = sampler(batch(LOGITS, 3), [row(logprobs=1), row(), row(logprobs=5)])
    assert out.logprob_token_ids.shape == (3, 6) and out.logprobs.shape == (3, 6)
    assert out.ranks.shape == (3,)


def test_processed_logprobs_reflect_the_sampling_transforms():
    kw = dict(temperature=0.5, top_k=4, logprobs=3)
    raw = sampler(batch(LOGITS, 1), [row(**kw)]).logprobs
    proc = sampler(batch(LOGITS, 1), [row(logprobs_mode="processed", **kw)]).logprobs
    assert not torch.allclose(raw[0, 1:], proc[0, 1:])
    top = LOGITS.topk(4).indices
    masked = torch.full((V,), -math.inf)
    masked[top] = LOGITS[top] / 0.5
    torch.testing.assert_close(proc[0, 1:], torch.log_softmax(masked, -1).topk(3).values)


def test_raw_and_processed_rows_can_share_a_batch():
    rows = [row(logprobs=2, temperature=0.5), row(logprobs=2, temperature=0.5,
                                                   logprobs_mode="processed")]
    out = sampler(batch(LOGITS, 2), rows)
    torch.testing.assert_close(out.logprobs[0, 1:], torch.log_softmax(LOGITS, -1).topk(2).values)
    torch.testing.assert_close(out.logprobs[1, 1:],
                               torch.log_softmax(LOGITS / 0.5, -1).topk(2).values)


def test_raw_logits_report_the_logits_as_given():
    kw = dict(temperature=0.5, top_k=4, logit_bias={3: 5.0}, logprobs=3, logprobs_mode="raw_logits")
    out = sampler(batch(LOGITS, 1), [row(**kw)])
    torch.testing.assert_close(out.logprobs[0, 1:], LOGITS.topk(3).values)
    assert out.logprobs[0, 0] == LOGITS[out.token_ids[0]]


def test_processed_logits_report_what_the_token_was_drawn_from():
    kw = dict(temperature=0.5, top_k=4, logprobs=V, logprobs_mode="processed_logits")
    out = sampler(batch(LOGITS, 1), [row(**kw)])
    top = LOGITS.topk(4).indices
    expected = torch.full((V,), -math.inf)
    expected[top] = LOGITS[top] / 0.5
    reported = torch.empty(V)
    reported[out.logprob_token_ids[0, 1:]] = out.logprobs[0, 1:]
    torch.testing.assert_close(reported, expected)


def test_each_row_reports_in_its_own_mode_within_one_batch():
    modes = ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
    out = sampler(batch(LOGITS, 4), [row(logprobs=2, temperature=0.5, logprobs_mode=m) for m in modes])
    expected = [torch.log_softmax(LOGITS, -1), torch.log_softmax(LOGITS / 0.5, -1), LOGITS, LOGITS / 0.5]
    for i, values in enumerate(expected):
        torch.testing.assert_close(out.logprobs[i, 1:], values.topk(2).values)
        assert out.logprobs[i, 0] == values[out.token_ids[i]]


def test_rank_counts_the_same_in_every_mode():
    modes = ["raw_logprobs", "raw_logits"]
    out = sampler(batch(LOGITS, 2), [row(logprobs=1, temperature=1.0, seed=3, logprobs_mode=m) for m in modes])
    chosen = out.token_ids.tolist()
    assert out.ranks.tolist() == [int((LOGITS > LOGITS[t]).sum()) + 1 for t in chosen]


def test_prompt_logprobs():
    logits = torch.randn(7, 30, generator=seeded(10))
    targets = torch.tensor([3, 0, 29, 5, 5, 17, 2])
    ids, lps, ranks = compute_prompt_logprobs(logits, targets, 3)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(ids[:, 0], targets)
    torch.testing.assert_close(lps[:, 0], raw.gather(1, targets[:, None])[:, 0])
    assert torch.equal(ids[:, 1:], raw.topk(3, -1).indices)
    torch.testing.assert_close(lps[:, 1:], raw.topk(3, -1).values)
    expected_ranks = (raw > raw.gather(1, targets[:, None])).sum(-1) + 1
    assert torch.equal(ranks, expected_ranks)


def test_prompt_logprobs_with_k_zero_return_only_the_target():
    ids, lps, ranks = compute_prompt_logprobs(torch.randn(4, 9), torch.tensor([0, 1, 2, 3]), 0)
    assert ids.shape == (4, 1) and lps.shape == (4, 1) and ranks.shape == (4,)


# ------------------------------------------------------------------ device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: needs CUDA")
def test_everything_stays_on_the_logits_device():
    logits = torch.randn(3, 100, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = sampler(logits, [row(logprobs=3, top_p=0.9, repetition_penalty=1.2, output=[1]),
                           row(temperature=0.0, logit_bias={5: 1.0}),
                           row(seed=0, generator=g, top_k=5, min_p=0.1)])
    assert out.token_ids.device == logits.device
    assert out.logprobs.device == logits.device
