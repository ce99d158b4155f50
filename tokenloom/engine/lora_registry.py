"""The adapters an EngineCore has accepted, each checked against the model before any request uses it.

A LoRA adapter is checked once, by its files' headers (tokenloom/lora/adapter_files.py `read_adapter_spec`: the
config and the tensors' shapes, no tensor data): rank within `--max-lora-rank`, every A/B pair the shape of
the layer it attaches to. So a corrupt folder or an adapter trained on another base model is one clear error
for the request (or the load call) that names it, and never a failed step that would touch other requests.
"""
from __future__ import annotations

from tokenloom.config import LoRAConfig
from tokenloom.core.lora_request import LoRARequest
from tokenloom.lora.adapter import LoRAAdapterError
from tokenloom.lora.adapter_files import read_adapter_spec


class LoRARegistry:
    def __init__(self, config: LoRAConfig, target_shapes: dict[str, tuple[int, int]], num_layers: int):
        self.config = config
        self.target_shapes = {name: (int(shape[0]), int(shape[1])) for name, shape in target_shapes.items()}
        self.num_layers = num_layers
        self.accepted: dict[int, LoRARequest] = {}

    def check(self, lora: LoRARequest) -> None:
        """Accept `lora` (once per id) or raise LoRAAdapterError saying why not."""
        if not self.config.enable_lora:
            raise LoRAAdapterError(f"model {lora.lora_name!r} is a LoRA adapter, and this engine serves none "
                                   "(start it with --enable-lora)")
        known = self.accepted.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} already names adapter {known.lora_name!r} "
                                       f"({known.lora_path}); give {lora.lora_name!r} an id of its own")
            return
        if not lora.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} has no path")
        spec = read_adapter_spec(lora.lora_path)
        missing = sorted({target for _, target, _ in spec.shapes} - set(self.target_shapes))
        if missing:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} trains {', '.join(missing)}, which this model "
                                   f"does not serve as LoRA targets ({', '.join(sorted(self.target_shapes))})")
        spec.check_fits(lora.lora_name, self.target_shapes, self.num_layers, self.config.max_lora_rank)
        self.accepted[lora.lora_int_id] = lora

    def remove(self, lora_int_id: int) -> bool:
        return self.accepted.pop(lora_int_id, None) is not None
