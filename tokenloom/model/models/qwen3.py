"""Qwen3: the Llama decoder with RMSNorm on each head's queries and keys (ArchConfig.qk_norm)."""
from tokenloom.model.models.llama import LlamaForCausalLM
from tokenloom.model.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
