"""Typed messages between the EngineCore and rank 0 of its workers (msgpack over ZMQ; never pickle).

Rank 0 forwards each `ExecuteModel` / `CallWorkers` / `Shutdown` to the other ranks as bytes over
torch.distributed (a broadcast reaches other machines too), and alone answers.
"""
from __future__ import annotations

import msgspec

from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.worker.worker_info import WorkerInfo


class ExecuteModel(msgspec.Struct, tag=True):
    step: SchedulerOutput


class Shutdown(msgspec.Struct, tag=True):
    pass


# Worker methods the engine may call on every rank between steps (`Executor.collective_rpc`).
WORKER_METHODS = ("update_weights_from_path", "update_weights_from_safetensors", "init_weights_update_group",
                  "update_weights_from_distributed", "destroy_weights_update_group", "sleep", "wake_up")
WorkerArg = str | int | float | bool | None


class CallWorkers(msgspec.Struct, tag=True):
    method: str
    args: list[WorkerArg] = []


class CallDone(msgspec.Struct, tag=True):
    pass


class CallFailed(msgspec.Struct, tag=True):
    """The call raised on rank 0 (every rank runs it alike); `kind` is the exception's class name."""

    error: str
    kind: str


class WorkerReady(msgspec.Struct, tag=True):
    info: WorkerInfo


class StepDone(msgspec.Struct, tag=True):
    output: ModelRunnerOutput


class StepFailed(msgspec.Struct, tag=True):
    """The step raised on rank 0: the EngineCore isolates the request that caused it, as in one process."""

    error: str
    kind: str  # the exception's class name


class StartupFailed(msgspec.Struct, tag=True):
    error: str


WorkerInput = ExecuteModel | Shutdown | CallWorkers
WorkerOutput = WorkerReady | StepDone | StepFailed | StartupFailed | CallDone | CallFailed

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(WorkerInput)
_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> WorkerInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> WorkerOutput:
    return _output_decoder.decode(data)
