"""The executor interface: how the EngineCore reaches its workers, wherever they run."""
from __future__ import annotations

from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.worker.worker_info import WorkerInfo


class ExecutorFault(RuntimeError):
    """A worker died, hung up or lost its peers: the engine, not one request, has failed."""


class Executor:
    def initialize(self) -> WorkerInfo:
        """Start the workers; returns rank 0's description once every rank is ready."""
        raise NotImplementedError

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's samples. A request's bug raises as in one process;
        a lost worker raises ExecutorFault."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise ExecutorFault if a worker is gone (called between steps as well)."""

    def shutdown(self) -> None:
        raise NotImplementedError

