"""The Llama decoder with a sparse mixture-of-experts block in place of the MLP on its sparse layers.

Families differ by their config flags (router renormalization, shared expert, q/k norms, q/k/v biases)
and by their checkpoint names, which `RENAMES` maps to one spelling (Qwen-MoE's) before loading:
`mlp.gate` (router), `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_expert*`. Stacked expert
tensors (GGUF's `*_exps`, transformers' `experts.gate_up_proj`) fill every expert at once.
"""
from __future__ import annotations

import re

import torch

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.layers.fused_moe import FusedMoE
from tokenloom.model.layers.moe import SparseMoeBlock
from tokenloom.model.models.llama import LlamaForCausalLM

_EXPERTS = re.compile(r"(?P<block>model\.layers\.\d+\.mlp)\.experts\.(?P<rest>.+)")
_STACKED = re.compile(r"(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?")
_PROJS = ("gate_proj", "up_proj", "down_proj")


class MoEForCausalLM(LlamaForCausalLM):
    # (pattern, replacement) applied to every checkpoint name, for families that spell it differently.
    RENAMES: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__(cfg, attention)  # built on the meta device by the loader: the replaced dense MLPs cost nothing
        for index, layer in enumerate(self.model.layers):
            if cfg.is_sparse_layer(index):
                layer.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                           cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                           cfg.shared_expert_intermediate_size)

    def canonical_name(self, name: str) -> str:
        for pattern, replacement in self.RENAMES:
            name = re.sub(pattern, replacement, name)
        return name

    def covered_names(self, name: str) -> set[str]:
        """The checkpoint_names() a checkpoint tensor fills (a stacked expert tensor fills one per expert)."""
        name = self.canonical_name(name)
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return {name}
        stacked = _STACKED.fullmatch(m["rest"])
        if stacked is None:
            return {name}
        projs = ("gate_proj", "up_proj") if stacked["proj"] == "gate_up_proj" else (stacked["proj"],)
        return {f"{m['block']}.experts.{e}.{p}.weight" for e in range(self.config.num_experts) for p in projs}

    def checkpoint_names(self) -> set[str]:
        names = {n for n in super().checkpoint_names() if ".experts." not in n}
        for path, module in self.named_modules():
            if isinstance(module, FusedMoE):
                names.update(f"{path}.{e}.{p}.weight" for e in range(module.num_experts) for p in _PROJS)
        return names

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = self.canonical_name(name)
        m = _EXPERTS.fullmatch(name)
        if m is not None:
            self.get_submodule(f"{m['block']}.experts").load(m["rest"], tensor)
        elif name.endswith("mlp.shared_expert_gate.weight"):
            super().load_weight(name, tensor.reshape(1, -1))  # GGUF stores the [1, hidden] gate as a vector
        else:
            super().load_weight(name, tensor)
