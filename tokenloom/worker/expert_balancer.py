"""The expert load balancer's step hook (vLLM's `--enable-eplb`): count, decide, move, between steps.

After every step that ran the model, each MoE layer's count of the (token, expert) pairs this rank computed
goes into a ring of the last `window_size` steps (one [layers, E] row per step, on the device: no host
sync). Every `step_interval` steps:

1. the window's counts, and each rank's total, are summed over the group with one all-reduce;
2. rank 0 computes each layer's placement (tokenloom.distributed.eplb) and broadcasts it, so every rank
   applies the same one even where floating-point ties could differ;
3. every layer moves its experts to it (FusedMoE.place: point-to-point copies between ranks).

Every rank runs the same steps in the same order (the executor broadcasts each one), so they all reach
step 2 together; the engine never stops for it, the step after simply runs on the new placement. Rank 0
returns an `ExpertLoadReport` with that step's output, which the engine keeps in its stats.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenloom.config import EPLBConfig
from tokenloom.core.contract import ExpertLoadReport
from tokenloom.distributed.eplb import balanced_placement, imbalance, rank_loads
from tokenloom.distributed.parallel_state import all_reduce, broadcast_bytes, tp_group
from tokenloom.model.layers.fused_moe import FusedMoE

logger = logging.getLogger("tokenloom.engine")


class ExpertBalancer:
    def __init__(self, layers: list[FusedMoE], config: EPLBConfig):
        self.layers, self.config = layers, config
        self.device = layers[0].w13.device
        self.window = torch.zeros(config.window_size, len(layers), layers[0].num_experts, dtype=torch.long,
                                  device=self.device)
        self.steps = self.rebalances = self.experts_moved = 0
        with torch.inference_mode():  # the counts and tables were made by inference-mode forwards
            for layer in layers:  # what warm-up routed is not load
                layer.replicas.take_load(self.device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: EPLBConfig | None) -> "ExpertBalancer | None":
        """The balancer of `model`'s MoE layers; None when the balancer is off."""
        layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.replicas is not None]
        return cls(layers, config) if layers and config is not None else None

    @torch.inference_mode()
    def after_step(self) -> ExpertLoadReport | None:
        """Record the step's load; every step_interval steps re-place the experts (the report on rank 0)."""
        self.window[self.steps % self.config.window_size] = torch.stack(
            [layer.replicas.take_load(self.device) for layer in self.layers])
        self.steps += 1
        if self.steps % self.config.step_interval:
            return None
        return self.rebalance()

    def rebalance(self) -> ExpertLoadReport | None:
        group = tp_group()
        num_experts = self.layers[0].num_experts
        counts = self.window.sum(dim=0)  # [layers, E]: pairs this rank computed
        totals = torch.zeros(len(self.layers), num_experts + group.size, dtype=torch.long, device=self.device)
        totals[:, :num_experts] = counts
        totals[:, num_experts + group.rank] = counts.sum(dim=-1)
        totals = all_reduce(totals).cpu()
        load, measured = totals[:, :num_experts].tolist(), totals[:, num_experts:].tolist()
        placements = self._agreed_placements(load, group.size)
        before = sum(imbalance(m) for m in measured) / len(measured)
        planned = sum(imbalance(rank_loads(lo, p, group.size)) for lo, p in zip(load, placements)) / len(load)
        self.experts_moved += sum(layer.place(p) for layer, p in zip(self.layers, placements))
        self.rebalances += 1
        report = ExpertLoadReport(rebalances=self.rebalances, experts_moved=self.experts_moved,
                                  window_steps=min(self.steps, self.config.window_size), imbalance=before,
                                  planned_imbalance=planned)
        if group.is_first:
            logger.log(logging.INFO if self.config.log_balancedness else logging.DEBUG,
                       "experts re-placed (%d): load max/mean per rank %.3f over the last %d steps, %.3f planned; "
                       "%d expert copies moved so far", report.rebalances, before, report.window_steps, planned,
                       report.experts_moved)
        return report if group.is_first else None

    def _agreed_placements(self, load: list[list[int]], num_ranks: int) -> list[list[int]]:
        """Rank 0's placement of every layer, on every rank."""
        payload = None
        if tp_group().is_first:
            placements = [balanced_placement(lo, layer.replicas.slots, num_ranks)
                          for lo, layer in zip(load, self.layers)]
            payload = np.asarray(placements, dtype=np.int64).tobytes()
        slots = len(self.layers[0].replicas.slots)
        return np.frombuffer(broadcast_bytes(payload), dtype=np.int64).reshape(len(self.layers), slots).tolist()
