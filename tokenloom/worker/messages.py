"""Typed messages between the EngineCore and rank 0 of its workers (msgpack over ZMQ; never pickle).

Rank 0 forwards each `ExecuteModel` / `Shutdown` to the other ranks as bytes over
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


WorkerInput = ExecuteModel | Shutdown
WorkerOutput = WorkerReady | StepDone | StepFailed | StartupFailed

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(WorkerInput)
_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> WorkerInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> WorkerOutput:
    return _output_decoder.decode(data)
