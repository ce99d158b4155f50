"""Qwen2: the Llama decoder with biases on the q, k and v projections (ArchConfig.attention_bias)."""
from tokenloom.model.models.llama import LlamaForCausalLM
from tokenloom.model.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
