"""Admission by expected completion time: the estimator and the decision, on given numbers.

The end-to-end behaviour (a real server under a flood) is tests/e2e/test_admission.py; these pin the arithmetic.
"""
from __future__ import annotations

import pytest

from tokenloom.engine.load_estimator import (
    BATCH_OVERHEAD_SEQS,
    DEFAULT_OUTPUT_RATE,
    PRIOR_MARGIN,
    PROMPT_TOKEN_WEIGHT,
    STALE_AFTER_S,
    LoadEstimator,
)
from tokenloom.entrypoints.openai.admission import Arrival, EngineLoad, Limits, decide, estimate

LIMITS = Limits(max_expected_latency=60.0, max_queue_wait=None, max_waiting_requests=256)
F = BATCH_OVERHEAD_SEQS


def steps(est: LoadEstimator, t0: float, period: float, count: int, batch: int) -> float:
    """`count` decode steps of `batch` sequences, one every `period` seconds; returns the last timestamp."""
    t = t0
    for _ in range(count):
        t += period
        est.observe_step(t, output_tokens=batch, step_tokens=batch, running=batch, busy_after=True)
    return t


def measured(period: float, batch: int) -> LoadEstimator:
    est = LoadEstimator()
    steps(est, 0.0, period, 6, batch)
    return est


def test_without_a_warm_up_the_guess_is_the_default_rate_at_a_full_batch():
    est = LoadEstimator()
    assert not est.measured and est.throughput(64) == pytest.approx(DEFAULT_OUTPUT_RATE)


def test_the_guess_comes_from_the_warm_up_step_and_slows_with_it():
    """A machine 10x slower at start-up (its warm-up decode step 10x longer) starts from a 10x slower guess."""
    quiet, slow = LoadEstimator(), LoadEstimator()
    quiet.calibrate(0.0326)
    slow.calibrate(0.326)
    assert quiet.step_seconds(1) == pytest.approx(PRIOR_MARGIN * 0.0326)
    assert slow.throughput(64) == pytest.approx(quiet.throughput(64) / 10)
    assert 25 < quiet.throughput(64) < 45  # about DEFAULT_OUTPUT_RATE on this machine when quiet


def test_a_step_after_idle_is_not_measured():
    est = LoadEstimator()
    est.observe_step(100.0, output_tokens=8, step_tokens=8, running=8, busy_after=True)  # first step after idle
    assert not est.measured
    est.observe_step(100.5, output_tokens=8, step_tokens=8, running=8, busy_after=False)  # then idle
    est.observe_step(160.0, output_tokens=1, step_tokens=1, running=1, busy_after=True)  # a minute later
    assert est.measured and est.rate == pytest.approx(16.0) and est.step_seconds(8) == pytest.approx(0.5)


def test_prompt_tokens_count_a_fifth_of_an_output_token():
    est = LoadEstimator()
    est.observe_step(0.0, output_tokens=0, step_tokens=0, running=4, busy_after=True)
    est.observe_step(1.0, output_tokens=4, step_tokens=504, running=4, busy_after=True)
    assert est.rate == pytest.approx(4 + 500 * PROMPT_TOKEN_WEIGHT)


def test_the_estimate_follows_a_slow_down_within_a_few_steps():
    """A full batch of 64 at 0.35 s per step, then the machine gets 4x slower: within 8 steps (about 11 s of
    the slow machine) the estimates are within 10 % of the new speed."""
    est = LoadEstimator()
    t = steps(est, 0.0, 0.35, 40, 64)
    assert est.throughput(64) == pytest.approx(64 / 0.35)
    steps(est, t, 1.4, 8, 64)
    assert est.throughput(64) == pytest.approx(64 / 1.4, rel=0.1)
    assert est.step_seconds(64) == pytest.approx(1.4, rel=0.1)


def test_a_fuller_batch_than_measured_costs_a_fixed_part_plus_a_part_per_sequence():
    est = measured(0.1, 16)
    assert est.step_seconds(16) == pytest.approx(0.1)
    assert est.step_seconds(64) == pytest.approx(0.1 * (F + 64) / (F + 16))
    assert est.step_seconds(1) == pytest.approx(0.1 * (F + 1) / (F + 16))
    assert est.throughput(64) == pytest.approx(64 / est.step_seconds(64))


def _busy(inflight: int, queued_work: float, waiting: int = 0) -> EngineLoad:
    return EngineLoad(inflight_seqs=inflight, engine_waiting=waiting, slots=64, queued_work=queued_work)


def test_expected_latency_is_the_drain_time_when_the_batch_is_full():
    est = measured(0.64, 64)  # 100 tokens/s at a full batch
    e = estimate(Arrival(seqs=1, tokens_per_seq=64, work=64), _busy(128, 128 * 64), est)
    assert e.latency == pytest.approx(129 * 64 / 100)
    assert e.wait == pytest.approx(e.latency - 64 * 0.64)


def test_expected_latency_is_its_own_decode_in_the_batch_it_joins_when_there_is_room():
    est = measured(0.1, 8)
    e = estimate(Arrival(seqs=1, tokens_per_seq=64, work=64), _busy(31, 31 * 2000), est)
    assert e.latency == pytest.approx(64 * 0.1 * (F + 32) / (F + 8))
    assert e.wait == 0  # the long requests ahead only fill the batch


def test_a_cold_flood_admits_only_what_the_guessed_speed_finishes_in_time():
    """400 arrivals of 64 tokens before any step is measured (warm-up step 32.6 ms): each admitted one
    reserves its work; the first batch stops where its own decode at the guessed speed would pass the limit
    (60 >= 64 x 4 x 0.0326 x (4 + k) / 5 for k <= 31), not at the 64 free slots."""
    est = LoadEstimator()
    est.calibrate(0.0326)
    inflight, work, admitted = 0, 0.0, 0
    for _ in range(400):
        arrival = Arrival(seqs=1, tokens_per_seq=64, work=64)
        if decide(arrival, _busy(inflight, work), est, LIMITS) is None:
            inflight, work, admitted = inflight + 1, work + arrival.work, admitted + 1
    assert admitted == 31
    assert estimate(Arrival(1, 64, 64), _busy(admitted - 1, work - 64), est).latency <= 60
    assert decide(Arrival(1, 64, 64), _busy(admitted, work), est, LIMITS).reason == "expected_latency"


def test_an_idle_engine_admits_what_it_can_finish_alone_even_past_its_own_timeout():
    """Its own timeout is left to the 504 path on an idle engine; the guess from the warm-up step is taken
    without its safety margin for a request that runs alone."""
    est = LoadEstimator()
    est.calibrate(0.0326)
    long = Arrival(seqs=1, tokens_per_seq=1500, work=1500, timeout=1.0)
    assert 1500 * 0.0326 < 60 and decide(long, _busy(0, 0.0), est, LIMITS) is None


def test_an_idle_engine_refuses_what_it_cannot_finish_alone_unless_that_is_stale():
    """On a machine so slow that one 64-token request alone takes longer than the limit (measured here under
    load: 3 s per step), it is refused at once; once no step has refreshed the estimate for a while, one
    request is let in to measure the machine again."""
    est = measured(3.0, 1)
    arrival = Arrival(seqs=1, tokens_per_seq=64, work=64)
    refusal = decide(arrival, _busy(0, 0.0), est, LIMITS, now=est.updated + 1)
    assert refusal is not None and refusal.reason == "expected_latency" and "alone" in refusal.message
    assert decide(arrival, _busy(0, 0.0), est, LIMITS, now=est.updated + STALE_AFTER_S + 1) is None


def test_a_timeout_shorter_than_the_expected_latency_is_refused_with_its_own_reason():
    est = measured(0.64, 64)
    refusal = decide(Arrival(seqs=1, tokens_per_seq=16, work=16, timeout=2.0), _busy(64, 64 * 64), est, LIMITS)
    assert refusal is not None and refusal.reason == "timeout_too_short" and "timeout" in refusal.message
    assert refusal.retry_after == 40  # ceil((64 * 64 + 16) / 100 - 2)
    assert decide(Arrival(seqs=1, tokens_per_seq=16, work=16, timeout=50.0), _busy(64, 64 * 64), est,
                  LIMITS) is None


def test_over_the_expected_latency_limit_is_refused_with_retry_after_the_excess():
    est = measured(0.64, 64)
    refusal = decide(Arrival(seqs=1, tokens_per_seq=64, work=64), _busy(64, 100 * 64), est, LIMITS)
    assert refusal is not None and refusal.reason == "expected_latency"
    assert refusal.retry_after == 5  # ceil(101 * 64 / 100 - 60)


def test_the_wait_limit_applies_to_the_wait_alone():
    est = measured(0.64, 64)
    limits = Limits(max_expected_latency=None, max_queue_wait=10.0, max_waiting_requests=None)
    # room in the batch: no wait, admitted; a full batch and 18 s more work ahead: refused
    assert decide(Arrival(seqs=1, tokens_per_seq=32, work=32), _busy(40, 40 * 32), est, limits) is None
    refusal = decide(Arrival(seqs=1, tokens_per_seq=32, work=32), _busy(64, 64 * 32 + 1800), est, limits)
    assert refusal is not None and refusal.reason == "queue_wait"


def test_the_count_backstop_is_checked_first():
    est = measured(1e-4, 64)  # a very fast engine: no time limit would refuse
    limits = Limits(max_expected_latency=60.0, max_queue_wait=None, max_waiting_requests=8)
    refusal = decide(Arrival(seqs=4, tokens_per_seq=1, work=4), _busy(64 + 6, 70.0), est, limits)
    assert refusal is not None and refusal.reason == "queue_full"
    # a request wider than the whole queue still gets in when nothing else is there
    assert decide(Arrival(seqs=80, tokens_per_seq=1, work=80), _busy(0, 0.0), est, limits) is None


def test_reservations_taken_over_leave_no_work_behind():
    """Float residue of reserved work made an idle engine look busy, so a request's own timeout was refused
    on an estimate (found by test_request_timeout after a flood)."""
    from tokenloom.engine.admission import Reservation, ReservedWork
    ledger = ReservedWork()
    reservations = [Reservation(ledger, 1, w) for w in (0.1, 0.2, 0.7, 16.3, 1e-9)]
    for r, w in zip(reservations, (0.3, 0.1, 0.7, 16.29, 0.0)):
        r.take(1, w)
    assert ledger.seqs == 0 and ledger.work == 0.0


def test_a_step_that_carried_a_prefill_chunk_does_not_make_decode_look_slower():
    """32 sequences decoding while 480 prompt tokens are prefilled in the same 0.6 s steps: a decode step of 33
    is expected to cost its share (u x (F + 33)), not the whole prefill-laden period (the quiet-machine
    benchmark's 32 streams were refused at 66 s expected for 8 s of real work before this)."""
    est = LoadEstimator()
    t = 0.0
    for _ in range(6):
        t += 0.6
        est.observe_step(t, output_tokens=32, step_tokens=32 + 480, running=32, busy_after=True)
    unit = 0.6 / (F + 32 + 480 * PROMPT_TOKEN_WEIGHT)
    assert est.step_seconds(33) == pytest.approx(unit * (F + 33))
    assert est.step_seconds(33) < 0.6 / 2
