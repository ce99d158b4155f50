"""Gemma 3 (text): the Llama decoder's parallel layers in Gemma's layer shape.

What differs from Llama, each as transformers' Gemma3ForCausalLM does it: RMSNorms that scale by
(1 + weight); four of them per layer (before and after attention, before and after the MLP); q/k norms;
embeddings multiplied by sqrt(hidden_size); a GeLU(tanh)-gated MLP; queries scaled by
query_pre_attn_scalar**-0.5; windowed ("sliding_attention") layers with their own rotary base and the
others ("full_attention", every 6th in the released models) with the global one; optional tanh
soft-capping of the final logits.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention import AttentionMetadata
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.layers.mlp import GatedMLP
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.norm import GemmaRMSNorm
from tokenloom.model.layers.rotary import RotaryEmbedding
from tokenloom.model.layers.vocab_parallel import VocabParallelEmbedding
from tokenloom.model.models.llama import LlamaForCausalLM, SelfAttention
from tokenloom.model.models.registry import register


class Gemma3Attention(SelfAttention):
    """Llama's attention block with Gemma's q/k norms, query scale and per-layer window."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attention: AttentionBackend, layer: int):
        super().__init__(cfg, rotary, attention, layer)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = attention.make_impl(self.num_heads, self.num_kv_heads, cfg.head_dim,
                                        scale=cfg.query_pre_attn_scalar ** -0.5,
                                        sliding_window=cfg.layer_window(layer))


class Gemma3DecoderLayer(InferenceModule):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attention: AttentionBackend, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, attention, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(InferenceModule):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)
        full = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        kinds = cfg.layer_types or ["full_attention"] * cfg.num_layers
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, local if kind == "sliding_attention" else full, attention, i)
            for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the activation dtype, as HF does

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the rows to start from, already scaled (`embed`), instead of the ids' (a prompt
        with images, whose rows enter unscaled as transformers' Gemma3Model scatters them)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)


@register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__(cfg, attention)  # on the meta device (the loader): the replaced Llama decoder costs nothing
        self.model = Gemma3Model(cfg, attention)

    def native_stack_spec(self) -> str:
        """Gemma's layer shape is not the stack's: (1 + weight) norms, four a layer, GeLU, scaled embeddings,
        two rotary tables."""
        return "Gemma 3's layer shape (four (1 + weight) norms a layer, GeLU, two rotary tables)"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
