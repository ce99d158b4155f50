"""The worker in the EngineCore's own process: no serialization, no copies (size 1, the default)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.executor.base import Executor, StepFuture, WorkerCallError
from tokenloom.worker.messages import WORKER_METHODS, WorkerArg
from tokenloom.worker.phases import WORKER_PHASES
from tokenloom.worker.worker import Worker
from tokenloom.worker.worker_info import WorkerInfo


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.worker = Worker(config, progress=progress)
        # Async scheduling: steps run on a thread of their own while the engine schedules the next one (torch
        # releases the GIL inside its ops, the native kernels included).
        self.steps = ThreadPoolExecutor(1, "tokenloom-step") if config.scheduler.async_scheduling else None

    def initialize(self) -> WorkerInfo:
        """Drive the worker through its start-up phases by name (device, weights, memory, KV cache, runner,
        warm-up), then read its description."""
        for phase in WORKER_PHASES:
            self.worker.run_phase(phase)
        return self.worker.info()

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(step)

    def submit_model(self, step: SchedulerOutput) -> StepFuture:
        if self.steps is None:
            return super().submit_model(step)
        return self.steps.submit(self._execute_on_step_thread, step)

    def _execute_on_step_thread(self, step: SchedulerOutput) -> ModelRunnerOutput:
        device = self.worker.plan.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
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
        if self.steps is not None:
            self.steps.shutdown(wait=True)
        self.worker.shutdown()
