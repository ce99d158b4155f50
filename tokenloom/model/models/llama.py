"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3 differ only by flags)."""
from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.arch_config import ArchConfig, UnsupportedModelError
from tokenloom.model.layers.attention import AttentionMetadata
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.layers.attention_native import NativeAttention
from tokenloom.model.layers.linear import QKVParallelLinear, RowParallelLinear, mixed_linear
from tokenloom.model.layers.mlp import GatedMLP
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.norm import RMSNorm
from tokenloom.model.layers.rotary import RotaryEmbedding
from tokenloom.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_logits
from tokenloom.model.models.registry import register
from tokenloom.model.stack_spec import NativeLayerSpec, NativeStackSpec, float32_rms_norm, panelled_weight

# Checkpoint projection name -> (merged module name, shard).
MERGED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class SelfAttention(InferenceModule):
    """Tensor parallel: each rank attends with its share of the heads (qkv column-parallel by heads, o_proj
    row-parallel), so one all-reduce per attention block."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attention: AttentionBackend, layer: int = 0):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = attention.make_impl(self.num_heads, self.num_kv_heads, cfg.head_dim,
                                        sliding_window=cfg.layer_window(layer))

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class DecoderLayer(InferenceModule):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attention: AttentionBackend, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, rotary, attention, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions, x, residual, kv_cache, meta):
        """x: the previous layer's MLP output (the embeddings for the first layer, with residual None);
        returns this layer's MLP output and the residual stream before it, to be added by the next norm
        (one fused add-and-norm per boundary)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def native_stack_spec(self) -> NativeLayerSpec | str:
        """This layer in the native stack's terms (tokenloom/model/stack_spec.py), or why it has none: the
        stack runs exactly what forward() runs, so anything forward() does on another path is a reason."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(attn.attn, NativeAttention):
            return "attention not on the native backend"
        if not isinstance(mlp, GatedMLP):
            return "a mixture-of-experts MLP"
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if (attn.q_norm is None) != (attn.k_norm is None):
            return "a norm on only one of q and k"
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        weights = [float32_rms_norm(n) for n in norms]
        if any(w is None for w in weights):
            return "norms other than float32 RMSNorm"
        if len({n.eps for n in norms}) != 1:
            return "norms with differing eps"
        linears = [panelled_weight(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(w is None for w in linears):
            return "weights not in the quantized panels (dense or unquantized)"
        if any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "biases on the o, gate/up or down projections"
        qkv_bias = attn.qkv_proj.bias
        if qkv_bias is not None and qkv_bias.dtype != torch.float32:
            return "a qkv bias other than float32"
        q_norm, k_norm = (weights[2], weights[3]) if attn.q_norm is not None else (None, None)
        return NativeLayerSpec(
            input_norm=weights[0], post_attention_norm=weights[1], qkv=linears[0], o=linears[1],
            gate_up=linears[2], down=linears[3], qkv_bias=None if qkv_bias is None else qkv_bias.data,
            q_norm=q_norm, k_norm=k_norm, window=attn.attn.window, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=float(norms[0].eps),
            scale=float(attn.attn.scale), activation=mlp.activation)


class DecoderModel(InferenceModule):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, attention, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the rows to start from instead of the ids' embeddings (a prompt with images)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def native_stack_spec(self) -> NativeStackSpec | str:
        """The decoder in the native stack's terms, or why some part of it has none."""
        if not len(self.layers):
            return "no layers"
        layers = []
        for i, layer in enumerate(self.layers):
            spec = layer.native_stack_spec()
            if isinstance(spec, str):
                return f"layer {i}: {spec}"
            layers.append(spec)
        final = float32_rms_norm(self.norm)
        if final is None:
            return "a final norm other than float32 RMSNorm"
        rotary = self.layers[0].self_attn.rotary
        if rotary.cos.dtype != torch.float32 or any(layer.self_attn.rotary is not rotary for layer in self.layers):
            return "rotary tables not shared in float32"
        return NativeStackSpec(embed_tokens=self.embed_tokens, layers=tuple(layers), final_norm=final,
                               final_norm_eps=float(self.norm.eps), rotary_cos=rotary.cos, rotary_sin=rotary.sin)


@register("LlamaForCausalLM")
class LlamaForCausalLM(InferenceModule):
    """Causal LM over a flat batch: forward() gives hidden states, compute_logits() the logits of chosen rows."""

    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, attention)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        # The tied embedding as the head multiplies by it (reduced precision, prepacked); the lookup stays dense.
        self.tied_head_weight: torch.Tensor | None = None

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def native_stack_spec(self) -> NativeStackSpec | str:
        """The model for the native stack (tokenloom/model/native_stack.py), or why it runs layer by layer.
        One tensor-parallel rank only: the stack has no all-reduce after o_proj and down_proj."""
        if tp_group().size != 1:
            return "tensor parallel"
        return self.model.native_stack_spec()

    def head_weight(self) -> torch.Tensor:
        """The output projection's weight, as compute_logits multiplies by it."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return self.model.embed_tokens.weight if self.tied_head_weight is None else self.tied_head_weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [T, V] on the first tensor-parallel rank (which samples); None on the others."""
        logits = gather_logits(mixed_linear(hidden, self.head_weight()), self.config.vocab_size)
        return None if logits is None else logits.float()

    def checkpoint_names(self) -> set[str]:
        """The checkpoint tensors (HF naming) that together fill every parameter through load_weight."""
        unmerged = {merged: name for name, merged in MERGED.items()}
        names = set()
        for name, _ in self.named_parameters():
            module_path, _, param = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            shards = getattr(self.get_submodule(module_path), "offsets", None)
            if shards:
                names.update(f"{parent}.{unmerged[(leaf, shard)]}.{param}" for shard in shards)
            else:
                names.add(name)
        return names

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Place one checkpoint tensor (HF naming) into the model."""
        if name == "lm_head.weight" and self.lm_head is None:
            return
        if name.startswith("model.rotary_emb") or name.endswith("rotary_emb.inv_freq"):
            return
        module_path, _, param = name.rpartition(".")
        shard = None
        parent, _, leaf = module_path.rpartition(".")
        if leaf in MERGED:
            leaf, shard = MERGED[leaf]
            module_path = f"{parent}.{leaf}"
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            raise UnsupportedModelError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}") from None
        if hasattr(module, "load"):
            module.load(param, tensor, shard)
        else:
            target = getattr(module, param)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(target.shape)}")
            target.data.copy_(tensor)
