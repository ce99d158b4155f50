"""Fault handling inside the EngineCore step, and test-only fault injection.

`recover_failed_step(core, sched, exc)` runs when executing a step's batch raised. A
bug that one request triggers (a logits processor, a sampler row, a token id that
slipped past validation...) must fail that request alone, so the batch is split in
halves and each half re-executed, recursively, until the request(s) that raise on their
own are found: they finish with ``finish_reason="error"`` and the others' outputs are
kept as if the step had succeeded. Cost: about 2*log2(batch) extra forwards per culprit,
paid only when a step fails. When every request of a batch holding two or more
requests fails on its own, the fault is not the requests' but the engine's (device
lost, out of memory...): the original exception is re-raised and the engine process
reports itself failed (the server then restarts it or exits). So does a lost worker
(`ExecutorFault`), without any re-run.

Re-running a sub-batch is safe because a step only writes the KV slots of its own new
tokens (rewritten with the same values) and the scheduler state is only advanced by
`Scheduler.update_from_output` after a successful run. Seeded requests in a failed batch may
draw from their generator twice when the fault came after sampling; they stay valid
samples but not the exact seeded sequence.

Under async scheduling the step after a failed one is usually running already, on samples the failed step
never produced, so neither can be kept or re-run piecewise (`requeue_lost_steps`): once the later step has
returned, the sequences of both compute again from their known tokens, as after a preemption, and run
without overlap until they finish, so the step that breaks again is the newest one and is bisected as
above. Cost: recomputing those sequences' tokens once, paid only when a step fails.

`FaultInjector` (off unless ``TOKENLOOM_FAULTS`` is set; used by the reliability tests
against a real engine) makes executing a batch misbehave when it holds a request whose
prompt starts with a given token id: ``TOKENLOOM_FAULTS="step_error=77777,step_hang=77778"``.
``step_error`` raises (a per-request bug), ``step_hang`` blocks the step for good (a
hung kernel / deadlock).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from tokenloom.core.contract import SchedulerOutput
from tokenloom.core.messages import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.executor.base import ExecutorFault
from tokenloom.scheduler.scheduler import engine_output

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore

logger = logging.getLogger("tokenloom.engine")

FAULTS_ENV = "TOKENLOOM_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by the FaultInjector (tests only)."""


class FaultInjector:
    def __init__(self, step_error: int | None = None, step_hang: int | None = None) -> None:
        self.step_error = step_error
        self.step_hang = step_hang

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = os.environ.get(FAULTS_ENV, "").strip()
        if not spec:
            return None
        kwargs: dict[str, int] = {}
        for item in spec.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in ("step_error", "step_hang"):
                raise ValueError(f"{FAULTS_ENV}: unknown fault {name!r}")
            kwargs[name] = int(value)
        logger.warning("fault injection is on: %s", spec)
        return cls(**kwargs)

    def before_execute(self, step: SchedulerOutput, requests: dict[str, Request]) -> None:
        for key in step.num_scheduled_tokens:
            r = requests[key]
            first = r.prompt_token_ids[0] if r.prompt_token_ids else None
            if first is None:
                continue
            if first == self.step_error:
                raise InjectedFault(f"injected fault for request {r.request_id}")
            if first == self.step_hang:
                logger.warning("injected hang for request %s", r.request_id)
                while True:
                    time.sleep(3600)


def requeue_lost_steps(core: EngineCore, steps: list[SchedulerOutput], exc: BaseException) -> list[EngineCoreOutput]:
    """`steps[0]` failed and the later ones (launched on its samples, already waited for) are void: their
    sequences compute again, one step at a time. Nothing is emitted for them now."""
    if isinstance(exc, ExecutorFault):
        raise exc
    keys = {k for step in steps for k in step.num_scheduled_tokens}
    logger.error("engine step with %d sequence(s) failed (%s: %s) while the next step ran on its samples; "
                 "%d sequence(s) compute again without overlap", len(steps[0].num_scheduled_tokens),
                 type(exc).__name__, exc, len(keys))
    core.scheduler.requeue_after_failure(steps)
    core.one_step_at_a_time.update(keys)
    return []


def recover_failed_step(core: EngineCore, step: SchedulerOutput, exc: BaseException) -> list[EngineCoreOutput]:
    """Find the request(s) whose processing raises, fail them, finish the others' step."""
    if isinstance(exc, ExecutorFault):
        raise exc  # a lost worker is the engine's failure, not a request's
    keys = list(step.num_scheduled_tokens)
    requests = core.scheduler.requests
    logger.error("engine step with %d sequence(s) failed (%s: %s); isolating the culprit",
                 len(keys), type(exc).__name__, exc)
    outputs: list[EngineCoreOutput] = []
    culprits: list[tuple[str, BaseException]] = []

    def run(batch: list[str]) -> None:
        sub = step.subset(batch)
        try:
            result = core.execute(sub)
        except ExecutorFault:
            raise
        except Exception as e:  # noqa: BLE001 - that is what we are looking for
            if len(batch) == 1:
                culprits.append((batch[0], e))
            else:
                split(batch)
            return
        outputs.extend(core.update(sub, result))

    def split(batch: list[str]) -> None:
        mid = len(batch) // 2
        run(batch[:mid])
        run(batch[mid:])

    if len(keys) == 1:
        culprits.append((keys[0], exc))
    else:
        split(keys)

    request_ids = {requests[k].request_id for k in keys}
    failed = {k: requests[k] for k, _ in culprits}
    if len(request_ids) > 1 and {r.request_id for r in failed.values()} == request_ids:
        logger.error("every request of the batch fails on its own: an engine fault, not a request's")
        raise exc
    handled: set[str] = set()
    for key, e in culprits:
        r = failed[key]
        if r.request_id in handled:
            continue
        handled.add(r.request_id)
        logger.error("request %s failed in the engine and is ended alone: %s: %s", r.request_id,
                     type(e).__name__, e, exc_info=(type(e), e, e.__traceback__))
        for seq in [q for q in list(requests.values()) if q.request_id == r.request_id]:
            core.scheduler.finish(seq, "error")
        out = engine_output(r, [])
        out.finish_reason = "error"
        out.error = f"{type(e).__name__}: {e}"
        outputs.append(out)
    return outputs
