"""Admission by expected completion time: answer at once whether a new request can finish in time.

An arrival is refused (503 + Retry-After, before it reaches the engine) when its *expected completion
time* — its wait for a place in the running batch plus its own decode at the speed of the batch it joins —
is over `--max-expected-latency` or over its own `timeout`, or when its wait alone is over
`--max-queue-wait`. The count of waiting sequences (`--max-waiting-requests`) stays as a backstop.

The estimate, with `engine/load_estimator.py`'s step time and throughput (measured over the last few engine
steps), W the work queued ahead (every open or admitted request's remaining tokens, decode-equivalent), w
the request's own work and L its tokens per sequence:

    own      = L * step_seconds(the batch it joins)             when a slot is free,
    expected = max((W + w) / R, own)                              when it must queue,

with R = throughput(a full batch).

The first is its own decode, slower in a fuller batch; the second the time to drain everything up to and
including it while the batch stays full (requests finish at rate R, so the last one queued completes when
the queue has drained). The wait is the expected time minus its own decode. An idle engine admits anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenloom.engine.load_estimator import LoadEstimator


@dataclass(frozen=True)
class Arrival:
    """What admission knows of a new request before tokenizing it."""

    seqs: int  # sequences it runs (prompts x n / best_of)
    tokens_per_seq: int  # max_tokens (or the context left) per sequence
    work: float  # decode-equivalent tokens in all (outputs plus weighted prompt tokens)
    timeout: float | None = None  # the request's own `timeout` field


@dataclass(frozen=True)
class EngineLoad:
    """The engine's state as admission sees it (open engine requests plus admitted ones not yet handed over)."""

    inflight_seqs: int
    engine_waiting: int  # sequences the engine's scheduler holds waiting
    slots: int  # --max-num-seqs
    queued_work: float  # decode-equivalent tokens still owed to the open and admitted requests


@dataclass(frozen=True)
class Limits:
    max_expected_latency: float | None  # seconds; None: no limit
    max_queue_wait: float | None
    max_waiting_requests: int | None  # sequences waiting for a slot; None: no limit


@dataclass(frozen=True)
class Refusal:
    reason: str  # the `reason` label of tokenloom:request_rejected_total
    message: str
    retry_after: int  # seconds, for the Retry-After header


@dataclass(frozen=True)
class Estimate:
    wait: float  # seconds until it gets a slot in the running batch
    latency: float  # seconds until its last token


def estimate(arrival: Arrival, load: EngineLoad, speed: LoadEstimator) -> Estimate:
    joined = min(load.slots, load.inflight_seqs + arrival.seqs)
    own = arrival.tokens_per_seq * speed.step_seconds(joined)
    if load.inflight_seqs + arrival.seqs <= load.slots and not load.engine_waiting:
        return Estimate(wait=0.0, latency=own)  # a slot is free: the work queued ahead only fills the batch
    latency = max((load.queued_work + arrival.work) / speed.throughput(load.slots), own)
    return Estimate(wait=latency - own, latency=latency)


# Output tokens per sequence assumed for a request without max_tokens (its allowance is the rest of the
# context, but chat replies end far sooner): its own decode time is estimated on this many, so that it is
# not refused on a merely busy server. The queued-work figure still counts its whole allowance.
UNSET_MAX_TOKENS_ESTIMATE = 256


def _retry(seconds: float) -> int:
    return max(1, min(600, math.ceil(seconds)))


def decide(arrival: Arrival, load: EngineLoad, speed: LoadEstimator, limits: Limits,
           mean_latency: float = 1.0, now: float | None = None) -> Refusal | None:
    """None: admit. Otherwise why not, checked in this order: the count backstop, the request's own timeout,
    the expected latency, the wait."""
    waiting_after = max(load.inflight_seqs + arrival.seqs - load.slots,
                        load.engine_waiting + arrival.seqs if load.engine_waiting else 0)
    busy = load.inflight_seqs > 0 or load.engine_waiting > 0
    limit = limits.max_waiting_requests
    if limit is not None and limit >= 0 and waiting_after > limit and busy:
        # A request wider than the whole queue still gets in when nothing else is there.
        return Refusal("queue_full", f"the server is overloaded: {max(0, load.inflight_seqs - load.slots)} "
                       f"sequence(s) already wait for a slot (limit {limit})", _retry(mean_latency))
    cap = limits.max_expected_latency
    if not busy and load.queued_work <= 0:
        # Idle: nothing waits ahead. Refused only when even alone it is expected to run past the limit (the
        # machine is that slow: measured, or at start-up from the warm-up step), unless that is stale (then it
        # runs as a probe); its own timeout is left to the 504 path, not refused on an estimate.
        alone = arrival.tokens_per_seq * speed.alone_seconds(arrival.seqs)
        if cap is not None and alone > cap and not speed.stale(now):
            return Refusal("expected_latency", f"the server is overloaded: even alone this request is expected to "
                           f"take {alone:.0f} s, more than the limit of {cap:g} s", _retry(alone - cap))
        return None
    est = estimate(arrival, load, speed)
    own = arrival.timeout
    if own is not None and est.latency > own:
        return Refusal("timeout_too_short", f"the expected time to complete, {est.latency:.1f} s, is longer than "
                       f"the request's timeout of {own:g} s", _retry(est.latency - own))
    if cap is not None and est.latency > cap:
        return Refusal("expected_latency", f"the server is overloaded: the expected time to complete is "
                       f"{est.latency:.0f} s, more than the limit of {cap:g} s", _retry(est.latency - cap))
    cap = limits.max_queue_wait
    if cap is not None and est.wait > cap:
        return Refusal("queue_wait", f"the server is overloaded: the expected wait is {est.wait:.0f} s, more than "
                       f"the limit of {cap:g} s", _retry(est.wait - cap))
    return None
