"""Which LoRA adapter a request runs with: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

It travels with the request to the EngineCore and, when its adapter goes into a slot, on to the workers,
which read the adapter from `lora_path`. `lora_int_id` (>= 1) is the adapter's identity everywhere: in the
slot pool, in the prefix cache's block hashes, across restarts of the same server.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, kw_only=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model it was trained on, as /v1/models names its parent

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (got {self.lora_int_id}); 0 is the base model")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


class LoRASlotLoad(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A step's instruction to the workers: put this adapter into slot `slot` before the forward (replacing
    whatever adapter was there)."""

    slot: int
    lora: LoRARequest
