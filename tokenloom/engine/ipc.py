"""Messages on the two ZMQ sockets between the frontend and the EngineCore process.

Frontend -> engine (input socket): AddRequest, AbortRequests, UtilityCall, Shutdown.
Engine -> frontend (output socket): Ready, StartupFailed, StepOutputs, Heartbeat,
UtilityResult, EngineFailed.

All are msgspec structs in one tagged union per direction, so one msgpack frame
decodes straight to the right type; nothing is ever pickled.
"""
from __future__ import annotations

from typing import Union

import msgspec

from tokenloom.core.engine_info import EngineInfo
from tokenloom.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenloom.core.stats import EngineStats

# What a utility call returns: stats -> EngineStats, reset_prefix_cache -> bool, ping -> "pong".
UtilityValue = Union[EngineStats, bool, str, None]
UtilityArg = Union[int, float, str, bool, None]

# ---------------------------------------------------------------- frontend -> engine

class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call"):
    """Call a named EngineCore method (see core_proc.UTILITY_METHODS); answered by UtilityResult."""

    call_id: int
    method: str
    args: list[UtilityArg] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = Union[AddRequest, AbortRequests, UtilityCall, Shutdown]


# ---------------------------------------------------------------- engine -> frontend

class Ready(msgspec.Struct, tag="ready"):
    """Sent once the EngineCore is built: what the frontend needs to know about it."""

    pid: int
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    error: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    timestamp: float
    # EngineCore.stats() after the step (gauges and cumulative counters); None when they failed.
    stats: EngineStats | None = None
    num_step_tokens: int = 0  # tokens computed in this step (for iteration_tokens_total)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    timestamp: float
    stats: EngineStats | None = None  # None from the heartbeat thread while a step runs
    step_elapsed: float = 0.0  # > 0: sent while a step has been running this long


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: UtilityValue = None
    error: str | None = None


class EngineFailed(msgspec.Struct, tag="failed"):
    """The step loop raised: the engine is going down; every request must fail."""

    error: str


EngineOutput = Union[Ready, StartupFailed, StepOutputs, Heartbeat, UtilityResult, EngineFailed]


_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> EngineOutput:
    return _output_decoder.decode(data)
