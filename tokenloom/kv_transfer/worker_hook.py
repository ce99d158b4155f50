"""A worker connector around the forward: hooks once per step id (fault isolation may re-run a step), and
its report kept until an output carries it (only the first rank answers, and a failed step answers nothing)."""
from __future__ import annotations

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

    def execute(self, step: SchedulerOutput, runner) -> ModelRunnerOutput | None:
        """The runner's step with the connector's hooks: loads begun, the forward walked layer by layer when the
        connector has layer work, saves waited for, and the report attached to the output."""
        meta = step.kv_connector
        first = meta is not None and step.step_id != self.step_id
        if first:
            self.step_id = step.step_id
            self.connector.start_load_kv(meta)
        runner.update_states(step)
        layers = LayerwiseCaches(runner.kv_caches, self.connector) if first and self.connector.has_layer_work() else None
        runner.kv_layers = layers
        try:
            out = runner.execute_model(step)
        finally:
            runner.kv_layers = None
            if layers is not None:
                layers.finish()
            if first:
                self.connector.wait_for_save(meta, runner.requests)
                self._merge(self.ranks.combine(self.connector.get_finished(idle=not step.num_scheduled_tokens)))
        if out is not None and (self.pending.sent or self.pending.loaded or self.pending.failed):
            out.kv_connector, self.pending = self.pending, KVConnectorOutput()
        return out

    def _merge(self, report: KVConnectorOutput) -> None:
        self.pending.sent.extend(report.sent)
        self.pending.loaded.extend(report.loaded)
        self.pending.failed.update(report.failed)
