"""A worker connector around the forward: hooks once per step id (fault isolation may re-run a step), and
its report kept until an output carries it (only the first rank answers, and a failed step answers nothing).

The runner owns one (it is built with it) and asks it around each step: `begin` before the step's deltas,
`layer_caches` for the forward, `finish` after it (even a failed one), `attach` on the output."""
from __future__ import annotations

import torch

from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.kv_metadata import KVConnectorOutput
from tokenloom.kv_transfer.layerwise import LayerwiseCaches
from tokenloom.kv_transfer.rank_reports import RankReports


class ConnectorHook:
    def __init__(self, connector: WorkerConnector):
        self.connector = connector
        self.step_id = -1
        self.pending = KVConnectorOutput()
        self.ranks = RankReports()

    def begin(self, step: SchedulerOutput) -> bool:
        """Loads begun, on the first run of a step that carries connector metadata; whether it is that run."""
        meta = step.kv_connector
        first = meta is not None and step.step_id != self.step_id
        if first:
            self.step_id = step.step_id
            self.connector.start_load_kv(meta)
        return first

    def layer_caches(self, kv_caches: list[torch.Tensor]) -> LayerwiseCaches | None:
        """The caches the forward walks, with the per-layer hooks between layers, when the connector has layer
        work this step; else None (the plain list)."""
        return LayerwiseCaches(kv_caches, self.connector) if self.connector.has_layer_work() else None

    def finish(self, step: SchedulerOutput, first: bool, layers: LayerwiseCaches | None, requests: dict) -> None:
        """After the forward: every layer's hooks, the saves waited for, the ranks' reports merged."""
        if layers is not None:
            layers.finish()
        if first:
            self.connector.wait_for_save(step.kv_connector, requests)
            self._merge(self.ranks.combine(self.connector.get_finished(idle=not step.num_scheduled_tokens)))

    def attach(self, out: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        """The output with the report kept so far (a rank that does not answer keeps it)."""
        if out is not None and (self.pending.sent or self.pending.loaded or self.pending.failed):
            out.kv_connector, self.pending = self.pending, KVConnectorOutput()
        return out

    def _merge(self, report: KVConnectorOutput) -> None:
        self.pending.sent.extend(report.sent)
        self.pending.loaded.extend(report.loaded)
        self.pending.failed.update(report.failed)
