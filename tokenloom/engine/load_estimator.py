"""The engine's recent speed, measured from its step times, for admission (see `entrypoints/openai/admission.py`).

Two figures, both short moving averages over the last few engine steps so that they follow the machine when
other work slows it down (a 10 s average lagged a sudden 4x slow-down by most of a full batch's run):

* `rate`: decode-equivalent tokens the engine completes per second of busy time (output tokens, plus
  prompt tokens weighted `PROMPT_TOKEN_WEIGHT`), the drain rate of the queue;
* `step_time`: seconds per engine step at the batch size seen (`batch`), i.e. what one sequence waits
  for each of its tokens.

A step's period is the time since the previous step's output when the engine stayed busy in between (it
had running or waiting requests after that step): it then went straight into the next step, so the period
is the step plus the engine loop's own overhead. The first step after idle is not measured.
"""
from __future__ import annotations

# A prompt token costs about a fifth of an output token at full batch on the CPU path: prefill runs
# at ~1,000 tokens/s, batched decode at ~165-230 output tokens/s (PERFORMANCE.md, this machine).
PROMPT_TOKEN_WEIGHT = 0.2
# Output tokens/s assumed before the engine has been measured (a flood that arrives at once is admitted
# on this alone): a quarter of the batched serving rate measured here unloaded (164.8 output tokens/s,
# PERFORMANCE.md). With 100, a cold flood of 400 x 64 tokens admitted 92 requests, which took 96 s on a
# quiet machine and timed out (> 180 s) with other work on its 2 cores; too high a guess fails requests,
# too low one only refuses (503) more of the first burst until the rate is measured.
DEFAULT_OUTPUT_RATE = 40.0
# Until measured, the rate is guessed from the warm-up's one-sequence decode step, timed at start-up so that
# it carries the machine's load then: batched serving here makes ~5.4 one-sequence steps' worth of tokens per
# such step (164.8 tokens/s at 32 streams, 32.6 ms per batch-1 step, PERFORMANCE.md); a quarter of that keeps
# the same margin as DEFAULT_OUTPUT_RATE (1.3 / 0.0326 s = 40 tokens/s on a quiet machine). On this machine
# with ~9 other processes per core, the warm-up step took ~30x longer and a flood admitted on 40 tokens/s
# took ~20x longer than its estimate.
WARMUP_RATE_FACTOR = 1.3
# Weight of the newest step in the moving averages: about the last 1 / STEP_ALPHA = 4 steps count, ~1.5 s
# at a full batch of 64 here (0.3-0.4 s per step), so a slow-down shows within a couple of seconds.
STEP_ALPHA = 0.25
# A period longer than this is not a step of a busy engine (a pause of the process, a debugger): skipped.
MAX_STEP_PERIOD_S = 30.0


class LoadEstimator:
    def __init__(self, prior_rate: float = DEFAULT_OUTPUT_RATE) -> None:
        self.prior_rate = prior_rate
        self.measured = False
        self._work = 0.0  # moving averages per step: decode-equivalent tokens, seconds, sequences running
        self._seconds = 0.0
        self._batch = 0.0
        self._last: float | None = None  # timestamp of the previous step, when the engine stayed busy after it

    def calibrate(self, warmup_decode_seconds: float) -> None:
        """Set the prior from the engine's warm-up decode step (seconds; 0: unknown, keep the default)."""
        if warmup_decode_seconds > 0:
            self.prior_rate = WARMUP_RATE_FACTOR / warmup_decode_seconds

    def observe_step(self, timestamp: float, output_tokens: int, step_tokens: int, running: int,
                     busy_after: bool) -> None:
        """One engine step's output: its timestamp, the tokens it sampled and computed, the sequences it ran,
        and whether requests were still running or waiting after it (the next step follows at once)."""
        last, self._last = self._last, (timestamp if busy_after else None)
        if last is None:
            return
        period = timestamp - last
        if not 0 < period <= MAX_STEP_PERIOD_S:
            return
        work = output_tokens + max(0, step_tokens - output_tokens) * PROMPT_TOKEN_WEIGHT
        batch = max(1, running, output_tokens)
        if not self.measured:
            self._work, self._seconds, self._batch, self.measured = work, period, batch, True
            return
        a = STEP_ALPHA
        self._work = (1 - a) * self._work + a * work
        self._seconds = (1 - a) * self._seconds + a * period
        self._batch = (1 - a) * self._batch + a * batch

    def idle(self) -> None:
        """The engine went idle: the next step's period is not a busy one."""
        self._last = None

    @property
    def rate(self) -> float:
        """Decode-equivalent tokens per second of busy engine time (the prior until measured)."""
        if not self.measured:
            return self.prior_rate
        return max(self._work / max(self._seconds, 1e-6), 1e-3)

    def seconds_per_token(self, batch: int) -> float:
        """Expected seconds between two tokens of one sequence in a batch of `batch` sequences: the measured
        step time, or `batch / rate` if that is longer (a fuller batch than the one measured is assumed to
        share the same throughput, which overstates its step time on the CPU path: on the safe side)."""
        per_step = self._seconds if self.measured else 0.0
        return max(per_step, max(1, batch) / self.rate)

    def wait_for(self, work_ahead: float) -> float:
        """Seconds until `work_ahead` decode-equivalent tokens are done at the current rate."""
        return work_ahead / self.rate
