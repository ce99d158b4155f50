"""The LoRA adapters a server serves by name: the `model` field of a request picks one, /v1/models lists them
with their parent, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the set at run time
(opt-in: --allow-runtime-lora-updating, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

An adapter is checked by the engine when it is added (its files against the model's shapes, its rank against
--max-lora-rank), so a bad one is a 400 for the load call, or a one-line start-up error for --lora-modules,
and never reaches a request. Each adapter gets an id of its own for the engine's slots and prefix cache; a
name unloaded and loaded again gets a new one, so nothing computed for the old files is reused.
"""
from __future__ import annotations

import itertools

from fastapi import FastAPI
from pydantic import BaseModel

from tokenloom.core.lora_request import LoRARequest
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.lora_modules import LoRAModule
from tokenloom.entrypoints.openai.errors import BadRequestError, NotFoundError


class LoRAModels:
    def __init__(self, engine: AsyncLLM, base_name: str, enabled: bool):
        self.engine = engine
        self.base_name = base_name
        self.enabled = enabled
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model is not None else None

    async def add(self, module: LoRAModule, reserved: list[str]) -> LoRARequest:
        """Check the adapter in the engine and serve it as `module.name` (BadRequestError says why not)."""
        if not self.enabled:
            raise BadRequestError("this server serves no LoRA adapters: start it with --enable-lora",
                                  param="lora_name", code="lora_disabled")
        if module.name in self.adapters or module.name in reserved:
            raise BadRequestError(f"the model name {module.name!r} is already in use", param="lora_name",
                                  code="lora_name_in_use")
        lora = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name or self.base_name)
        try:
            await self.engine.client.call_utility("add_lora", lora.lora_name, lora.lora_int_id, lora.lora_path)
        except RuntimeError as e:
            raise BadRequestError(str(e).removeprefix("LoRAAdapterError: "), param="lora_path",
                                  code="invalid_lora_adapter") from None
        self.adapters[module.name] = lora
        return lora

    async def remove(self, name: str) -> None:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                                code="model_not_found")
        await self.engine.client.call_utility("remove_lora", lora.lora_int_id)

    def cards(self, created: int) -> list[dict[str, object]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "tokenloom",
                 "root": lora.lora_path, "parent": lora.base_model_name, "max_model_len": self.engine.max_model_len}
                for name, lora in self.adapters.items()]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def register_lora_routes(app: FastAPI, models: LoRAModels, reserved: list[str]) -> None:
    """vLLM's run-time adapter endpoints; their answers are plain text, as vLLM's are."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        await models.add(LoRAModule(request.lora_name, request.lora_path, request.base_model_name), reserved)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        await models.remove(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
