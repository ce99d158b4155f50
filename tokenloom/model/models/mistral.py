"""Mistral: the Llama decoder; its sliding window (when the config sets one) limits every layer's attention
(ArchConfig.layer_window), and the scheduler frees KV blocks behind it."""
from tokenloom.model.models.llama import LlamaForCausalLM
from tokenloom.model.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    pass

