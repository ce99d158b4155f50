"""The EngineCore's state for serving inside a training loop: paused, asleep, and which weights serve.

A trainer updates the weights many times an hour. What happens to requests in flight is the caller's
choice, made in the API process (`tokenloom/engine/weight_updates.py`): by default an update waits for them
to finish on the old weights; after `/pause_generation` they wait here, unscheduled, keep their KV cache,
and continue on the new weights after `/continue_generation` (the stated mix of the two).

The prefix cache never hands a later request KV computed with other weights: every update bumps a version
that salts the block hashes of the requests that arrive after it, so blocks cached before (or filled
afterwards by a paused request that began before) never match them; the free ones are dropped at once.
"""
from __future__ import annotations

from collections.abc import Callable

from tokenloom.executor.base import WorkerCallError
from tokenloom.scheduler.kv_cache_manager import KVCacheManager


class WeightControlError(ValueError):
    """A training-loop call the engine refused, with the reason (a 400 or 409 at the API)."""


class WeightControl:
    def __init__(self, kv_manager: KVCacheManager):
        self.kv_manager = kv_manager
        self.paused = False
        self.sleep_level = 0  # 0 awake; 1 KV cache dropped; 2 weights dropped too
        self.version = 0  # updates applied so far

    @property
    def running(self) -> bool:
        return not self.paused and not self.sleep_level

    def salted(self, cache_salt: str | None) -> str | None:
        """A request's prefix-cache salt under the current weights (unchanged until the first update)."""
        if not self.version:
            return cache_salt
        return f"{cache_salt or ''}\x00weights-{self.version}"

    def update(self, load: Callable[[], None]) -> None:
        """Run `load` on the workers; on success, later requests hash under the new weights' version."""
        if self.sleep_level:
            raise WeightControlError("the engine is asleep: wake it up (/wake_up) before updating its weights")
        self.on_workers(load)
        self.version += 1
        self.kv_manager.reset_prefix_cache()  # drops the free blocks' hashes now (refused while any is in use)

    @staticmethod
    def on_workers(call: Callable[[], None]) -> None:
        """Run a worker call; what a worker refused or failed at becomes the caller's WeightControlError."""
        try:
            call()
        except WorkerCallError as exc:
            raise WeightControlError(str(exc)) from None

    def check_can_sleep(self, level: int, busy: bool) -> None:
        if level not in (1, 2):
            raise WeightControlError(f"sleep level must be 1 (drop the KV cache) or 2 (the weights too), "
                                     f"got {level!r}")
        if busy:
            raise WeightControlError("the engine has requests in flight; sleep needs an idle engine")
