"""The engine's recent speed, measured from its step times, for admission (see `entrypoints/openai/admission.py`).

Short moving averages over the last few engine steps (so that they follow the machine when other work slows
it down; a 10 s average lagged a sudden 4x slow-down by most of a full batch's run) of a step's period, the
sequences it ran and the decode-equivalent tokens it completed (output tokens, plus prompt tokens weighted
`PROMPT_TOKEN_WEIGHT`). From them, for a batch of b sequences:

* `step_seconds(b)`: what one sequence waits for each of its tokens in a decode step of b sequences. A step
  costs a fixed part plus a part per decode-equivalent token, step = u x (F + work), with F =
  `BATCH_OVERHEAD_SEQS`; u is averaged over the measured steps, so a step that also carried a prefill chunk
  counts as the heavier step it was (taking its period as a decode step's made a batch of 32 look 3x slower
  than it decodes, and refused requests that finished in 8 s as taking 66 s);
* `throughput(b)`: decode-equivalent tokens per second at b sequences, the drain rate of a queue.

A step's period is the time since the previous step's output when the engine stayed busy in between (it had
running or waiting requests after that step): it then went straight into the next step, so the period is the
step plus the engine loop's own overhead. The first step after idle is not measured. Until a step is measured
the figures are guessed from the engine's warm-up decode step (timed at start-up, so it carries the
machine's load then), or from `DEFAULT_OUTPUT_RATE` when there was none.
"""
from __future__ import annotations

import time

# A prompt token costs about a fifth of an output token at full batch on the CPU path: prefill runs
# at ~1,000 tokens/s, batched decode at ~165-230 output tokens/s (docs/performance.md, this machine).
PROMPT_TOKEN_WEIGHT = 0.2
# The fixed cost of a decode step, in sequences' worth: measured here, a batch-1 step takes 32.6 ms and
# serving 32 streams makes 164.8 tokens/s (a 194 ms step), 5.9x for 32x the sequences, so F ~ 5.5; 4 is
# on the safe side (a fuller batch is assumed a little slower than it is).
BATCH_OVERHEAD_SEQS = 4.0
# Before any step is measured the warm-up's decode step (one sequence) is taken this many times slower than
# it was: the warm-up is one step, and a flood that arrives at once is admitted on this guess alone (with
# 1x, a cold flood of 400 x 64 tokens admitted 92 requests that took 96 s on a quiet machine and timed out
# past 180 s with other work on its 2 cores; too slow a guess only refuses (503) more of the first burst).
PRIOR_MARGIN = 4.0
# Output tokens/s at a full batch of 64 assumed when there was no warm-up step to time: a quarter of the
# batched serving rate measured here unloaded (164.8 output tokens/s, docs/performance.md).
DEFAULT_OUTPUT_RATE = 40.0
DEFAULT_BATCH = 64
# Weight of the newest step in the moving averages: about the last 1 / STEP_ALPHA = 4 steps count, ~1.5 s
# at a full batch of 64 here (0.3-0.4 s per step), so a slow-down shows within a couple of seconds.
STEP_ALPHA = 0.25
# An estimate not refreshed by a measured step for this long is stale: an idle engine then admits one request
# it would otherwise refuse, as a probe of the machine's speed now (else a server started or left on a busy
# machine would refuse everything forever once the machine is quiet again).
STALE_AFTER_S = 60.0
# A period longer than this is not a step of a busy engine (a pause of the process, a debugger): skipped.
MAX_STEP_PERIOD_S = 30.0


class LoadEstimator:
    def __init__(self) -> None:
        self.measured = False
        # per step: seconds, sequences running, decode-equivalent tokens (the prior until measured: one
        # sequence's step, at which a full batch of DEFAULT_BATCH makes DEFAULT_OUTPUT_RATE)
        full = DEFAULT_BATCH / DEFAULT_OUTPUT_RATE
        self._unit = full / (BATCH_OVERHEAD_SEQS + DEFAULT_BATCH)  # seconds per decode-equivalent token, F included
        self._seconds = self._unit * (BATCH_OVERHEAD_SEQS + 1)
        self._work = 1.0
        self._last: float | None = None  # timestamp of the previous step, when the engine stayed busy after it
        self.updated = time.monotonic()  # when the figures were last calibrated or measured

    def calibrate(self, warmup_decode_seconds: float) -> None:
        """The prior from the engine's warm-up decode step of one sequence (seconds; 0: unknown, keep the default)."""
        if warmup_decode_seconds > 0 and not self.measured:
            self._seconds, self._work = PRIOR_MARGIN * warmup_decode_seconds, 1.0
            self._unit = self._seconds / (BATCH_OVERHEAD_SEQS + 1)
            self.updated = time.monotonic()

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
        unit = period / (BATCH_OVERHEAD_SEQS + max(1.0, work, running))
        self.updated = time.monotonic()
        if not self.measured:
            self._seconds, self._work, self._unit, self.measured = period, work, unit, True
            return
        a = STEP_ALPHA
        self._seconds = (1 - a) * self._seconds + a * period
        self._work = (1 - a) * self._work + a * work
        self._unit = (1 - a) * self._unit + a * unit

    @property
    def rate(self) -> float:
        """Decode-equivalent tokens per second at the batch measured (or assumed)."""
        return max(self._work / max(self._seconds, 1e-6), 1e-3)

    def step_seconds(self, batch: int) -> float:
        """Expected seconds of one engine step with `batch` sequences: between two tokens of each."""
        return self._unit * (BATCH_OVERHEAD_SEQS + batch)

    def alone_seconds(self, batch: int) -> float:
        """step_seconds without the prior's safety margin: what a request running alone is expected to see."""
        return self.step_seconds(batch) / (1.0 if self.measured else PRIOR_MARGIN)

    def stale(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self.updated > STALE_AFTER_S

    def throughput(self, batch: int) -> float:
        """Decode-equivalent tokens per second with `batch` sequences running."""
        return max(max(batch, 1) / self.step_seconds(batch), 1e-3)
