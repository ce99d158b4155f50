"""HTTP endpoints for serving inside a training loop, with SGLang's and vLLM's names.

Off unless asked for, since they let a caller change what the server answers with:
`--enable-weight-updates` opens the weight updates and pause/continue, `--enable-sleep-mode` (vLLM's flag)
opens sleep and wake; `VLLM_SERVER_DEV_MODE=1` opens both, as it does in vLLM. `--api-key` covers them.
"""
from __future__ import annotations

import json
from typing import Literal

from fastapi import FastAPI, Query
from pydantic import Field

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.weight_updates import WeightUpdateRefused
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.protocol import OpenAIBaseModel

MAX_TENSORS = 100_000  # an 8B model has ~300 tensors; a MoE a few thousand
MAX_NAME_LEN = 1024


class UpdateFromDiskRequest(OpenAIBaseModel):
    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = Field(None, max_length=64)  # SGLang's; the path's own format is used


class InitGroupRequest(OpenAIBaseModel):
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=65536)
    group_name: str | None = Field(None, max_length=255)
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateFromDistributedRequest(OpenAIBaseModel):
    names: list[str] = Field(min_length=1, max_length=MAX_TENSORS)
    dtypes: list[Literal["float32", "float16", "bfloat16"]] = Field(min_length=1, max_length=MAX_TENSORS)
    shapes: list[list[int]] = Field(min_length=1, max_length=MAX_TENSORS)
    flush_cache: bool = True  # SGLang's: the prefix cache is always reset on an update


class GroupRequest(OpenAIBaseModel):
    group_name: str | None = Field(None, max_length=255)


def _ok(message: str) -> dict:
    return {"success": True, "message": message}


def _refused(exc: WeightUpdateRefused) -> BadRequestError:
    return BadRequestError(str(exc), code="weight_update_refused")


def register_weight_update_routes(app: FastAPI, engine: AsyncLLM) -> None:
    updates = engine.weight_updates

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateFromDiskRequest):
        """Serve the weights at model_path (same architecture and shapes); in-flight requests finish first."""
        try:
            await updates.update_from_disk(request.model_path)
        except WeightUpdateRefused as exc:
            raise _refused(exc) from None
        return _ok(f"serving the weights of {request.model_path}")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: InitGroupRequest):
        if engine.data_parallel_size > 1:
            raise BadRequestError("weight-sync groups need one engine replica (data_parallel_size 1); update "
                                  "replicas from disk instead", code="weight_update_refused")
        try:
            await updates.init_group(request.master_address, request.master_port, request.rank_offset,
                                     request.world_size, request.backend)
        except WeightUpdateRefused as exc:
            raise _refused(exc) from None
        return _ok("joined the weight-sync group")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: UpdateFromDistributedRequest):
        """Receive each named tensor by broadcast from the trainer (rank 0), in order, then serve them."""
        if not len(request.names) == len(request.dtypes) == len(request.shapes):
            raise BadRequestError("names, dtypes and shapes must have one entry per tensor", param="names")
        if any(len(n) > MAX_NAME_LEN for n in request.names) or any(len(s) > 8 or min(s, default=0) < 0
                                                                    for s in request.shapes):
            raise BadRequestError("a tensor name over 1024 characters, or a shape of over 8 dimensions or a "
                                  "negative one", param="names")
        metas = json.dumps([{"name": n, "dtype": d, "shape": s}
                            for n, d, s in zip(request.names, request.dtypes, request.shapes)])
        try:
            await updates.update_from_distributed(metas)
        except WeightUpdateRefused as exc:
            raise _refused(exc) from None
        return _ok(f"serving {len(request.names)} tensors received from the trainer")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: GroupRequest | None = None):
        await updates.destroy_group()
        return _ok("left the weight-sync group")

    @app.post("/pause_generation")
    async def pause_generation():
        """Stop scheduling: requests in flight keep their place (and KV cache) until /continue_generation."""
        await updates.pause()
        return _ok("generation paused")

    @app.post("/continue_generation")
    async def continue_generation():
        await updates.resume()
        return _ok("generation continues")


def register_sleep_routes(app: FastAPI, engine: AsyncLLM) -> None:
    updates = engine.weight_updates

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=1, le=2)):
        """Free memory while idle: level 1 the KV cache, level 2 the weights too. Requests in flight finish
        first; new ones get 503 with Retry-After until /wake_up."""
        try:
            await updates.sleep(level)
        except WeightUpdateRefused as exc:
            raise _refused(exc) from None
        return _ok(f"asleep at level {level}")

    @app.post("/wake_up")
    async def wake_up():
        await updates.wake_up()
        return _ok("awake")

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(updates.sleep_level)}
