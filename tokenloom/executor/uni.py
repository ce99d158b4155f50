"""The worker in the EngineCore's own process: no serialization, no copies (size 1, the default)."""
from __future__ import annotations

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.executor.base import Executor
from tokenloom.worker.phases import WORKER_PHASES
from tokenloom.worker.worker import Worker
from tokenloom.worker.worker_info import WorkerInfo


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.worker = Worker(config, progress=progress)

    def initialize(self) -> WorkerInfo:
        """Drive the worker through its start-up phases by name (device, weights, memory, KV cache, runner,
        warm-up), then read its description."""
        for phase in WORKER_PHASES:
            self.worker.run_phase(phase)
        return self.worker.info()

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(step)

    def shutdown(self) -> None:
        self.worker.shutdown()
