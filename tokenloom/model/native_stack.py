"""A Llama-family model's step on the CPU in one native call: the CPU's answer to CUDA graphs.

A small model's decode step at batch 1 is dominated by what surrounds its ops: the embedded SmolLM2 makes
~330 native op calls a step (11 a layer), each with its Python (the layers' forward, the linear methods)
and its dispatch, ~4 ms of a 13.7 ms step. `tokenloom::decoder_stack` (csrc/decoder_stack.cpp) runs the
same ops in the same order from C++, so its hidden states are the layer-by-layer forward's bit for bit,
and a step costs one Python call for the whole stack: decodes, prefill chunks, or both.

It serves a `LlamaForCausalLM` whose layers all run on the native ops: quantized weights in the
interleaved panels (GGUF, exact or W4A8), no biases, no QK norm, SiLU, float32 RMSNorm, the native
attention backend, one tensor-parallel rank. Any other model runs layer by layer, and so does every step
under `--enforce-eager`, with a KV connector's per-layer hooks, or under the step profiler (which times
the layers' ops apart).
"""
from __future__ import annotations

import logging

import torch

from tokenloom.profiler import PROFILER

logger = logging.getLogger("tokenloom.engine")


class NativeStack:
    """The argument lists of `tokenloom::decoder_stack` for one loaded model, built once."""

    def __init__(self, model):
        layers = model.model.layers
        attn = layers[0].self_attn
        self.embed_tokens = model.model.embed_tokens
        self.final_norm = model.model.norm
        self.rotary = attn.rotary
        self.weights: list[torch.Tensor] = []  # per layer: its two norms, then each linear's panels
        self.linears = []  # each layer's qkv, o, gate_up, down QuantizedWeight, layer after layer
        for layer in layers:
            self.weights += [layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data]
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                p = linear.weight.panels
                self.weights += [p.qpacked, p.scales, p.mins]
                self.linears.append(linear.weight)
        self.windows = [layer.self_attn.attn.window for layer in layers]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = float(model.config.rms_norm_eps)
        self.scale = float(attn.attn.scale)
        self._modes: list[bool] | None = None
        self._layer_ints: list[int] = []

    def layer_ints(self) -> list[int]:
        """Per layer: its window, then (columns, bits, block size, int8 activations) of each linear. Rebuilt
        when a weight's path changed (`set_quantized_matmul` switches loaded weights in place)."""
        modes = [w.activations_int8 for w in self.linears]
        if modes != self._modes:
            ints: list[int] = []
            for layer, window in enumerate(self.windows):
                ints.append(window)
                for w in self.linears[4 * layer:4 * layer + 4]:
                    ints += [w.panels.columns, w.bits, w.block_size, int(w.activations_int8)]
            self._modes, self._layer_ints = modes, ints
        return self._layer_ints

    @classmethod
    def build(cls, model, attention_backend_name: str) -> NativeStack | None:
        """The fast path for this model, or None (with a debug line saying why) when some layer needs the
        eager forward."""
        reason = _unsupported(model, attention_backend_name)
        if reason:
            logger.debug("steps run layer by layer: %s", reason)
            return None
        return cls(model)

    @staticmethod
    def can_run() -> bool:
        return not PROFILER.enabled

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """The final norm's output for the flat batch; `meta` is the native backend's NativeAttentionMetadata."""
        return torch.ops.tokenloom.decoder_stack(
            self.embed_tokens(input_ids), positions, self.weights, self.layer_ints(), self.final_norm.weight,
            self.rotary.cos, self.rotary.sin, kv_caches, meta.slot_mapping, meta.num_decodes, meta.block_tables,
            meta.context_lens, meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_context_lens,
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale)


def _unsupported(model, attention_backend_name: str) -> str | None:
    """Why this model's steps cannot take the native stack, or None when they can."""
    from tokenloom import kernels
    from tokenloom.distributed.parallel_state import tp_group
    from tokenloom.model.layers.attention_native import NativeAttention
    from tokenloom.model.layers.norm import RMSNorm
    from tokenloom.model.layers.quantized_weight import QuantizedWeight
    from tokenloom.model.models.llama import DecoderLayer, DecoderModel, LlamaForCausalLM

    if not kernels.enabled():
        return "the native kernels are off"
    if type(model) is not LlamaForCausalLM or type(model.model) is not DecoderModel:
        return f"{type(model).__name__} is not a Llama-family decoder"
    if tp_group().size != 1:
        return "tensor parallel"
    if attention_backend_name != "native":
        return f"the {attention_backend_name} attention backend"
    layers = list(model.model.layers)
    if not layers:
        return "no layers"
    scales = set()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not DecoderLayer or type(attn.attn) is not NativeAttention:
            return f"layer {i} is not a native Llama layer"
        if attn.q_norm is not None:
            return "QK norm"
        if mlp.activation != "silu":
            return f"the {mlp.activation} activation"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms):
            return "norms other than float32 RMSNorm"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear.bias is not None:
                return "linear biases"
            if not isinstance(linear.weight, QuantizedWeight) or linear.weight.panels is None:
                return "weights not in the quantized panels (dense or unquantized)"
        scales.add(attn.attn.scale)
    if len(scales) != 1:
        return "attention scales that differ between layers"
    final = model.model.norm
    if type(final) is not RMSNorm or final.weight.dtype != torch.float32:
        return "a final norm other than float32 RMSNorm"
    rotary = layers[0].self_attn.rotary
    if rotary.cos.dtype != torch.float32 or any(layer.self_attn.rotary is not rotary for layer in layers):
        return "rotary tables not shared in float32"
    return None
