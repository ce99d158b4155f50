"""The worker in the EngineCore's own process: no serialization, no copies (size 1, the default)."""
from __future__ import annotations

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.executor.base import Executor, WorkerCallError
from tokenloom.worker.messages import WORKER_METHODS, WorkerArg
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

    def collective_rpc(self, method: str, *args: WorkerArg) -> None:
        if method not in WORKER_METHODS:
            raise ValueError(f"unknown worker method {method!r}")
        try:
            getattr(self.worker, method)(*args)
        except Exception as e:  # noqa: BLE001 - the same error the process executor reports
            raise WorkerCallError(type(e).__name__, str(e)) from e

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        try:
            self.worker.update_weights_from_tensors(tensors)
        except Exception as e:  # noqa: BLE001
            raise WorkerCallError(type(e).__name__, str(e)) from e

    def shutdown(self) -> None:
        self.worker.shutdown()
