"""New weights for a running worker: from a path, from tensors in memory, or broadcast by a trainer.

The replacement loads beside the serving model through the same loader (so each rank shards it as it
would a checkpoint), and only a complete, loaded model replaces the old one: a path with another
architecture, a missing tensor or a wrong shape fails before anything changes, and the old weights keep
serving. The cost is room for a second copy of the weights while the new one loads.
"""
from __future__ import annotations

from dataclasses import fields

import msgspec

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.loader import read_arch_config

# The fields that fix a model's parameter shapes: an update may change values, never these.
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size")


class WeightUpdateError(ValueError):
    """An update the worker refused; the serving weights are unchanged. Its message becomes the 400's."""


class TensorMeta(msgspec.Struct, frozen=True):
    """One tensor a trainer is about to broadcast: its checkpoint name, dtype name and shape."""

    name: str
    dtype: str
    shape: list[int]


def check_same_shapes(serving: ArchConfig, new: ArchConfig, source: str) -> None:
    known = {f.name for f in fields(ArchConfig)}
    for name in SHAPE_FIELDS:
        if name in known and getattr(serving, name) != getattr(new, name):
            raise WeightUpdateError(f"{source}: {name} is {getattr(new, name)!r}, the serving model's is "
                                    f"{getattr(serving, name)!r}; an update must keep the architecture and shapes")


def arch_at(path: str) -> ArchConfig:
    try:
        return read_arch_config(path)
    except (OSError, ValueError, KeyError) as exc:
        raise WeightUpdateError(f"{path}: cannot read a model there ({type(exc).__name__}: {exc})") from None


def decode_metas(metas_json: str) -> list[TensorMeta]:
    try:
        return msgspec.json.decode(metas_json, type=list[TensorMeta])
    except msgspec.DecodeError as exc:
        raise WeightUpdateError(f"tensor list: {exc}") from None
