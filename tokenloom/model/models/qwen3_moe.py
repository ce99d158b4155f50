"""Qwen3-MoE and Qwen2-MoE: the MoE decoder with Qwen's flags.

Qwen3-MoE: q/k RMSNorm, no shared expert, top-k weights renormalized when `norm_topk_prob`
(Qwen3-30B-A3B sets it). Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate, no
renormalization. Checkpoint names are already the canonical ones (moe_decoder.py).
"""
from tokenloom.model.models.moe_decoder import MoEForCausalLM
from tokenloom.model.models.registry import register


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoEForCausalLM):
    pass


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(MoEForCausalLM):
    pass
