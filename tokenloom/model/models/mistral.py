"""Mistral: the Llama decoder (sliding-window attention is not used at these context lengths)."""
from tokenloom.model.models.llama import LlamaForCausalLM
from tokenloom.model.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    pass
