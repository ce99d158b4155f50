"""A worker connector around the forward: once per step id (fault isolation may re-run a step), and its
report kept until an output carries it (only the first rank answers, and a failed step answers nothing)."""
from __future__ import annotations

from tokenloom.executor.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.kv_transfer.base import WorkerConnector
from tokenloom.kv_transfer.metadata import KVConnectorOutput


class ConnectorHook:
    def __init__(self, connector: WorkerConnector):
        self.connector = connector
        self.loaded_step = self.published_step = -1
        self.pending = KVConnectorOutput()

    def before_forward(self, step: SchedulerOutput) -> None:
        if step.kv_connector is not None and step.step_id != self.loaded_step:
            self.loaded_step = step.step_id
            self.pending.failed.update(self.connector.before_forward(step.kv_connector))

    def after_forward(self, step: SchedulerOutput, requests: dict, out: ModelRunnerOutput | None):
        if step.kv_connector is not None and step.step_id != self.published_step:
            self.published_step = step.step_id
            self.pending.sent.extend(self.connector.after_forward(step.kv_connector, requests))
        if out is not None and (self.pending.sent or self.pending.failed):
            out.kv_connector, self.pending = self.pending, KVConnectorOutput()
        return out
