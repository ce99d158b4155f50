"""Which LoRA adapter sits in which of the workers' `--max-loras` slots: the scheduler's side of the pool.

The scheduler admits a request whose adapter is resident, or can be made resident now: a free slot, or the
least recently used slot whose adapter no running request uses. Otherwise the request stays waiting and the
requests behind it go ahead, so an adapter waiting for a slot never holds up the batch. Every adapter a
running request uses is resident, so a step never mixes more than `--max-loras` adapters. A slot change
travels to the workers in the next step contract (`SchedulerOutput.lora_loads`), applied before its forward.
"""
from __future__ import annotations

from collections import OrderedDict

from tokenloom.core.lora_request import LoRARequest, LoRASlotLoad


class LoRASlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.pending: list[LoRASlotLoad] = []  # loads the workers have not been told of yet
        self.num_loads = 0

    def acquire(self, lora: LoRARequest, busy: set[int]) -> bool:
        """Make `lora` resident (now, or by a load in the next step); False when every slot holds an adapter
        in `busy` (used by a running request)."""
        lid = lora.lora_int_id
        if lid in self.resident:
            self.resident.move_to_end(lid)
            return True
        slot = self._free_slot(busy)
        if slot is None:
            return False
        self.resident[lid] = slot
        self.pending.append(LoRASlotLoad(slot=slot, lora=lora))
        self.num_loads += 1
        return True

    def _free_slot(self, busy: set[int]) -> int | None:
        used = set(self.resident.values())
        free = next((s for s in range(self.num_slots) if s not in used), None)
        if free is not None:
            return free
        victim = next((lid for lid in self.resident if lid not in busy), None)
        return None if victim is None else self.resident.pop(victim)

    def forget(self, lora_int_id: int, busy: set[int]) -> None:
        """An unloaded adapter: its slot is free for the next one at once, or, while running requests still use
        it, once least recently used like any other."""
        if lora_int_id not in busy:
            self.resident.pop(lora_int_id, None)

    def take_loads(self) -> list[LoRASlotLoad]:
        loads, self.pending = self.pending, []
        return loads
