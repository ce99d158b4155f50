"""The API process's side of serving inside a training loop: what happens to requests around a weight update
or a sleep (the engine's side is tokenloom/engine/weight_control.py).

- An update (from disk, or broadcast by a trainer) holds new arrivals at a gate, lets the requests in flight
  finish on the old weights, applies the update, and reopens the gate: no answer mixes two sets of weights.
  After `pause()` it does not wait: the paused requests keep their KV cache and continue on the new weights
  after `resume()`, the one mix there is, and the caller asked for it.
- `sleep(level)` turns new arrivals away (the server answers 503 with Retry-After), waits for the requests
  in flight, then frees the KV cache (level 1) or the weights too (level 2); `wake_up()` rebuilds them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tokenloom.engine import ipc

# A weight update loads a whole model; a trainer's broadcast of an 8B model over gloo takes minutes.
UPDATE_TIMEOUT_S = 3600.0
# How often a drain looks at the number of requests in flight.
DRAIN_POLL_S = 0.01

UtilityCall = Callable[..., Awaitable[ipc.UtilityValue]]


class WeightUpdateRefused(ValueError):
    """The engine refused the call; the message says why (a 400 at the API)."""


class EngineAsleepError(RuntimeError):
    """A request arrived while the engine sleeps (a 503 with Retry-After at the API)."""


class WeightUpdates:
    def __init__(self, call_utility: UtilityCall, num_inflight: Callable[[], int]):
        self._call_utility = call_utility
        self._num_inflight = num_inflight
        self.open = asyncio.Event()  # new requests pass while set
        self.open.set()
        self._lock = asyncio.Lock()  # one update or sleep at a time
        self.paused = False
        self.sleep_level = 0

    async def admitted(self) -> None:
        """Where a new request waits during an update; raises EngineAsleepError while the engine sleeps."""
        if self.sleep_level:
            raise EngineAsleepError(f"the engine is asleep (level {self.sleep_level}); wake it with /wake_up")
        await self.open.wait()
        if self.sleep_level:
            raise EngineAsleepError(f"the engine is asleep (level {self.sleep_level}); wake it with /wake_up")

    async def update_from_disk(self, path: str) -> None:
        await self._exclusive("update_weights_from_disk", path)

    async def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         backend: str) -> None:
        await self._call("init_weights_update_group", master_address, master_port, rank_offset, world_size, backend)

    async def update_from_distributed(self, metas_json: str) -> None:
        await self._exclusive("update_weights_from_distributed", metas_json)

    async def destroy_group(self) -> None:
        await self._call("destroy_weights_update_group")

    async def pause(self) -> None:
        await self._call("pause_generation")
        self.paused = True

    async def resume(self) -> None:
        await self._call("continue_generation")
        self.paused = False

    async def sleep(self, level: int) -> None:
        async with self._lock:
            if level not in (1, 2):
                raise WeightUpdateRefused(f"sleep level must be 1 or 2, got {level}")
            self.sleep_level = level  # arrivals are turned away from now on
            try:
                await self._drain()
                await self._call("sleep", level)
            except BaseException:
                self.sleep_level = 0
                raise

    async def wake_up(self) -> None:
        async with self._lock:
            await self._call("wake_up")
            self.sleep_level = 0

    async def _exclusive(self, method: str, *args: ipc.UtilityArg) -> None:
        async with self._lock:
            self.open.clear()
            try:
                if not self.paused:
                    await self._drain()
                await self._call(method, *args)
            finally:
                self.open.set()

    async def _drain(self) -> None:
        while self._num_inflight():
            await asyncio.sleep(DRAIN_POLL_S)

    async def _call(self, method: str, *args: ipc.UtilityArg) -> None:
        try:
            await self._call_utility(method, *args, timeout=UPDATE_TIMEOUT_S)
        except RuntimeError as exc:
            kind, _, message = str(exc).partition(": ")
            if kind in ("WeightControlError", "WeightUpdateError", "WeightSyncError"):
                raise WeightUpdateRefused(message) from None
            raise
