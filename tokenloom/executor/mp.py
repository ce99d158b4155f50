"""One process per rank, started and watched by the EngineCore.

The EngineCore talks to rank 0 only (two ZMQ sockets on 127.0.0.1); rank 0 forwards each
step to the other ranks over torch.distributed. While it waits for an answer, the executor
checks every 100 ms that its workers are alive: a worker that dies is an `ExecutorFault`
(the engine fails and the server reports it; nothing waits forever). A worker that hangs is
caught by the engine's step timeout, as a hung forward in one process would be.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile

import torch
import zmq
from safetensors.torch import save_file

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.executor.base import Executor, ExecutorFault, StepFuture, WorkerCallError
from tokenloom.model.loader import read_arch_config
from tokenloom.worker import messages
from tokenloom.worker.messages import WorkerArg
from tokenloom.worker.worker_info import WorkerInfo
from tokenloom.worker.worker_proc import start_workers

logger = logging.getLogger("tokenloom.engine")

POLL_MS = 100  # how often a waiting executor checks its workers' pulse
SHUTDOWN_GRACE_S = 5.0


class WorkerStepError(RuntimeError):
    """A step raised inside rank 0: treated like the same exception in one process."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True):
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ConfigError("only node 0 runs the engine; start other nodes with `tokenloom serve ... "
                              f"--node-rank {parallel.node_rank}`, which runs their workers")
        read_arch_config(config.model.model).check_tensor_parallel(parallel.world_size,
                                                                   parallel.enable_expert_parallel,
                                                                   parallel.redundant_experts)
        self.config = config
        self.ctx = zmq.Context()
        self.to_rank0 = self.ctx.socket(zmq.PUSH)
        self.to_rank0.setsockopt(zmq.LINGER, 0)
        self.from_rank0 = self.ctx.socket(zmq.PULL)
        self.from_rank0.setsockopt(zmq.LINGER, 0)
        input_addr = _bind(self.to_rank0)
        output_addr = _bind(self.from_rank0)
        port = parallel.rendezvous_port or _free_port()
        self.procs: dict[int, subprocess.Popen] = start_workers(config, port, input_addr, output_addr, progress)
        self._closed = False

    def initialize(self) -> WorkerInfo:
        msg = self._receive()
        if isinstance(msg, messages.StartupFailed):
            self.shutdown()
            raise RuntimeError(f"worker start-up failed: {msg.error}")
        if not isinstance(msg, messages.WorkerReady):
            raise ExecutorFault(f"unexpected first message from rank 0: {type(msg).__name__}")
        return msg.info

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit_model(step).result()

    def submit_model(self, step: SchedulerOutput) -> StepFuture:
        """Rank 0 takes steps in order from its socket and answers in that order: a step sent while the one
        before runs waits there, and each reply is read by the step's `result()`, oldest first."""
        self.to_rank0.send(messages.encode(messages.ExecuteModel(step=step)))
        return _StepReply(self)

    def read_step_reply(self) -> ModelRunnerOutput:
        msg = self._receive()
        if isinstance(msg, messages.StepDone):
            return msg.output
        if isinstance(msg, messages.StepFailed):
            raise WorkerStepError(f"{msg.kind}: {msg.error}")
        raise ExecutorFault(f"unexpected message from rank 0: {type(msg).__name__}")

    def collective_rpc(self, method: str, *args: WorkerArg) -> None:
        self.to_rank0.send(messages.encode(messages.CallWorkers(method=method, args=list(args))))
        msg = self._receive()
        if isinstance(msg, messages.CallFailed):
            raise WorkerCallError(msg.kind, msg.error)
        if not isinstance(msg, messages.CallDone):
            raise ExecutorFault(f"unexpected message from rank 0: {type(msg).__name__}")

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The worker processes read the tensors from one safetensors file (in shared memory where the
        machine has it): tensors never cross a socket as pickles."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=folder) as f:
            save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, f.name)
            self.collective_rpc("update_weights_from_safetensors", f.name)

    def _receive(self):
        while not self.from_rank0.poll(POLL_MS):
            self.check_health()
        return messages.decode_output(self.from_rank0.recv())

    def check_health(self) -> None:
        dead = [f"worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
                for rank, proc in self.procs.items() if proc.poll() is not None]
        if dead:
            raise ExecutorFault("; ".join(dead))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        intact = all(p.poll() is None for p in self.procs.values())
        if intact:  # otherwise the survivors wait on a dead peer: no point asking them
            self.to_rank0.send(messages.encode(messages.Shutdown()))
        for proc in self.procs.values():
            try:
                proc.wait(SHUTDOWN_GRACE_S if intact else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in (self.to_rank0, self.from_rank0):
            sock.close()
        self.ctx.term()

    def __del__(self):
        for proc in getattr(self, "procs", {}).values():
            if proc.poll() is None:
                proc.kill()


class _StepReply:
    def __init__(self, executor: MultiprocExecutor):
        self.executor = executor

    def result(self) -> ModelRunnerOutput:
        return self.executor.read_step_reply()


def _bind(sock: zmq.Socket) -> str:
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
