"""An adapter's files, whatever their format: a PEFT folder or a llama.cpp GGUF LoRA file (told apart by the
GGUF magic), read the same way by the API process (the header only), the EngineCore's checks and the workers."""
from __future__ import annotations

from pathlib import Path

from tokenloom.core.lora_request import LoRARequest
from tokenloom.lora.adapter import LoRAAdapter
from tokenloom.lora.gguf_loader import is_gguf_lora, load_gguf_lora_adapter, read_gguf_lora_spec
from tokenloom.lora.peft_loader import PeftAdapterSpec, load_peft_adapter, read_peft_spec


def read_adapter_spec(path: str | Path) -> PeftAdapterSpec:
    """Rank, alpha and every pair's shape, without reading the tensors."""
    return read_gguf_lora_spec(path) if is_gguf_lora(path) else read_peft_spec(path)


def load_adapter(lora: LoRARequest, num_heads: int | None = None, num_kv_heads: int | None = None) -> LoRAAdapter:
    """The adapter's tensors; the head counts are the base model's (a llama.cpp file's q/k rows need them)."""
    if is_gguf_lora(lora.lora_path):
        return load_gguf_lora_adapter(lora, num_heads, num_kv_heads)
    return load_peft_adapter(lora)
