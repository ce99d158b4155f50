"""Which executor an engine gets: its workers in this process (`uni`) or one process per rank (`mp`)."""
from __future__ import annotations

from tokenloom.config import EngineConfig
from tokenloom.executor.base import Executor
from tokenloom.executor.mp import MultiprocExecutor
from tokenloom.executor.uni import UniExecutor


def make_executor(config: EngineConfig, progress: bool = True) -> Executor:
    if config.parallel.executor_backend == "uni":
        return UniExecutor(config, progress)
    return MultiprocExecutor(config, progress)
