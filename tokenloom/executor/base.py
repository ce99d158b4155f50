"""The executor interface: how the EngineCore reaches its workers, wherever they run."""
from __future__ import annotations

from typing import Protocol

import torch

from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.worker.messages import WorkerArg
from tokenloom.worker.worker_info import WorkerInfo


class ExecutorFault(RuntimeError):
    """A worker died, hung up or lost its peers: the engine, not one request, has failed."""


class WorkerCallError(RuntimeError):
    """A worker method called through `collective_rpc` raised; `kind` is the original exception's class."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class StepFuture(Protocol):
    """A step handed to the workers: `result()` waits for its samples, or raises what running it raised."""

    def result(self) -> ModelRunnerOutput: ...


class FinishedStep:
    """A step that has run already (an executor that runs steps as they come) or failed before it ran."""

    def __init__(self, output: ModelRunnerOutput | None = None, error: Exception | None = None):
        self.output, self.error = output, error

    def result(self) -> ModelRunnerOutput:
        if self.error is not None:
            raise self.error
        return self.output


class Executor:
    def initialize(self) -> WorkerInfo:
        """Start the workers; returns rank 0's description once every rank is ready."""
        raise NotImplementedError

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's samples. A request's bug raises as in one process;
        a lost worker raises ExecutorFault."""
        raise NotImplementedError

    def submit_model(self, step: SchedulerOutput) -> StepFuture:
        """Hand one step to the workers and return without waiting where the executor can, so the engine
        schedules the next step meanwhile (async scheduling); steps run in the order submitted and their
        results are read in that order. Here: run it now."""
        try:
            return FinishedStep(self.execute_model(step))
        except Exception as e:  # noqa: BLE001 - raised when the engine reads the result, as from a worker
            return FinishedStep(error=e)

    def collective_rpc(self, method: str, *args: WorkerArg) -> None:
        """Call a worker method (`worker.messages.WORKER_METHODS`) on every rank, between steps; rank 0's
        exception is raised here as a `WorkerCallError` carrying the original's class name and message."""
        raise NotImplementedError

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve these weights (every tensor, checkpoint names) on every rank."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise ExecutorFault if a worker is gone (called between steps as well)."""

    def shutdown(self) -> None:
        raise NotImplementedError

