"""The worker's side of the adapter pool: `--max-loras` slots on the model's layers, and a host cache.

The scheduler decides which adapter goes into which slot (tokenloom/scheduler/lora_slots.py) and says so in
the step contract; `LoRASlots.apply` carries the loads out before the step's forward: the adapter is read
from the host cache, or from its files (then kept there, least recently used evicted past `--max-cpu-loras`),
and copied into every target's slot, zero where the adapter does not train a target. Each row of the step
then reads its request's slot (`row_slots`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from tokenloom.core.lora_request import LoRARequest, LoRASlotLoad
from tokenloom.lora.adapter import LoRAAdapter, LoRAAdapterError
from tokenloom.lora.adapter_files import load_adapter
from tokenloom.lora.layer import LoRABatch, LoRATarget

AdapterReader = Callable[[LoRARequest], LoRAAdapter]


def read_adapter(lora: LoRARequest) -> LoRAAdapter:
    """An adapter from its files, whatever their format (without the base model's head counts: the workers pass
    a reader that has them)."""
    return load_adapter(lora)


class LoRASlots:
    def __init__(self, batch: LoRABatch, targets: dict[tuple[int, str], LoRATarget], max_rank: int,
                 max_cpu_loras: int, reader: AdapterReader = read_adapter):
        self.batch = batch
        self.targets = targets
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.reader = reader
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.device = batch.scaling.device

    def apply(self, loads: list[LoRASlotLoad]) -> None:
        for load in loads:
            adapter = self._read(load.lora)
            for key, target in self.targets.items():
                target.load(load.slot, adapter.weights.get(key))
            self.batch.scaling[load.slot] = adapter.scaling
            self.slot_of = {lid: s for lid, s in self.slot_of.items() if s != load.slot}
            self.slot_of[adapter.id] = load.slot

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.host.get(lora.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = self.reader(lora)
        adapter.check_rank(self.max_rank)
        unknown = sorted(key for key in adapter.weights if key not in self.targets)
        if unknown:
            layer, target = unknown[0]
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} trains layer {layer} {target}, which this "
                                   "model does not have as a LoRA target")
        self.host[lora.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def row_slots(self, row_adapters: list[int]) -> torch.Tensor | None:
        """int32 slot per row for the step's rows' adapter ids (0: the base model, slot -1); None when no row
        uses an adapter, so the layers skip LoRA entirely."""
        if not any(row_adapters):
            return None
        slots = [self.slot_of[lid] if lid else -1 for lid in row_adapters]
        return torch.tensor(slots, dtype=torch.int32, device=self.device)
