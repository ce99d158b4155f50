"""Mixtral: the MoE decoder with eight experts as wide as the MLP, top-2 renormalized (the same as a
softmax over the two chosen logits), no shared expert. Its HF names (`block_sparse_moe`, w1/w3/w2)
are mapped to the canonical ones (moe_decoder.py)."""
from tokenloom.model.models.moe_decoder import MoEForCausalLM
from tokenloom.model.models.registry import register


@register("MixtralForCausalLM")
class MixtralForCausalLM(MoEForCausalLM):
    RENAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
               (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))
