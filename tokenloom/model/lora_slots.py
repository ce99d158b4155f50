"""LoRA slots on a model's linear layers: which projections adapters can target, and their buffers.

`attach_lora` gives each decoder layer's qkv, o, gate_up and down projections a `LoRALayer` (one
`LoRATarget` per checkpoint projection, sharded like the layer) and returns the targets by (layer, name),
which the worker's slot pool fills. A mixture-of-experts layer's MLP has no dense projections: its gate,
up and down are not targets (an adapter that trains them is refused by `target_shapes`' absence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenloom.lora.layer import LoRABatch, LoRALayer, LoRATarget, Narrow
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass
class ModelLoRA:
    batch: LoRABatch
    targets: dict[tuple[int, str], LoRATarget]
    target_shapes: dict[str, tuple[int, int]]  # checkpoint name -> unsharded (in, out)
    num_layers: int


def attach_lora(model: nn.Module, arch: ArchConfig, num_slots: int, max_rank: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> ModelLoRA:
    """`dtype`: the slots' (--lora-dtype); the delta is computed in float32 whatever they hold."""
    batch = LoRABatch(num_slots, device)
    targets: dict[tuple[int, str], LoRATarget] = {}
    names: set[str] = set()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        for module, name in ((getattr(layer.self_attn, "qkv_proj", None), "qkv"),
                             (getattr(layer.self_attn, "o_proj", None), "o_proj"),
                             (getattr(layer.mlp, "gate_up_proj", None), "gate_up"),
                             (getattr(layer.mlp, "down_proj", None), "down_proj")):
            parts = _targets(module, name, num_slots, max_rank, device, dtype)
            if not parts:
                continue
            module.lora = LoRALayer(batch, parts)
            targets.update({(i, name): t for name, t in parts.items()})
            names.update(parts)
    shapes = {name: shape for name, shape in _full_shapes(arch).items() if name in names}
    return ModelLoRA(batch, targets, shapes, len(layers))


def _targets(module: nn.Module | None, name: str, slots: int, rank: int, device: torch.device,
             dtype: torch.dtype) -> dict[str, LoRATarget]:
    """The module's targets by checkpoint name; `name` is its place (qkv, o_proj, gate_up, down_proj)."""
    if name == "qkv" and isinstance(module, QKVParallelLinear):
        out = {}
        for shard in ("q", "k", "v"):
            start, size = module.offsets[shard]
            index = module.tp.rank if shard == "q" else module.tp.rank // module.kv_replicas
            out[f"{shard}_proj"] = LoRATarget(slots, rank, module.in_features, size, start, None,
                                              Narrow(0, index * size, size), device, dtype)
        return out
    if name == "gate_up" and isinstance(module, MergedColumnParallelLinear) and set(module.offsets) == {"gate", "up"}:
        out = {}
        for shard in ("gate", "up"):
            start, size = module.offsets[shard]
            out[f"{shard}_proj"] = LoRATarget(slots, rank, module.in_features, size, start, None,
                                              Narrow(0, module.tp.rank * size, size), device, dtype)
        return out
    if name in ("o_proj", "down_proj") and isinstance(module, RowParallelLinear):
        size = module.in_features
        return {name: LoRATarget(slots, rank, size, module.out_features, 0, Narrow(1, module.tp.rank * size, size),
                                 None, device, dtype)}
    return {}


def _full_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    h, q, kv, m = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}
