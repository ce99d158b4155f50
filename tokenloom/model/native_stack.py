"""A decoder model's step on the CPU in one native call: the CPU's answer to CUDA graphs.

A small model's decode step at batch 1 is dominated by what surrounds its ops: the embedded SmolLM2 makes
~330 native op calls a step (11 a layer), each with its Python (the layers' forward, the linear methods)
and its dispatch, ~4 ms of a 13.7 ms step. `tokenloom::decoder_stack` (csrc/decoder_stack.cpp) runs the
same ops in the same order from C++, so its hidden states are the layer-by-layer forward's bit for bit,
and a step costs one Python call for the whole stack: decodes, prefill chunks, or both.

It serves the Llama-family decoders, whose layers differ only by flags the op takes as well: Llama (and
SmolLM2), Mistral (with its sliding window, if the config sets one), Qwen2 (a bias on the qkv projection)
and Qwen3 (RMSNorm on each query and key head before rotary). The model describes itself
(`native_stack_spec()`, tokenloom/model/stack_spec.py) and this module builds the op's arguments from that
description alone, so the stack follows a model's layers without knowing their modules. A model takes it
when its layers all run on the native ops: quantized weights in the interleaved panels (GGUF, exact or
W4A8), SiLU, float32 RMSNorm, the native attention backend, one tensor-parallel rank. Any other model
(Gemma 3's layer shape, a mixture of experts, dense weights) runs layer by layer, and so does every step
under `--enforce-eager`, with a KV connector's per-layer hooks, or under the step profiler (which times
the layers' ops apart).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenloom import kernels
from tokenloom.lora.adapter import LORA_TARGETS
from tokenloom.lora.layer import LoRATarget
from tokenloom.model.layers.quantized_weight import QuantizedWeight
from tokenloom.model.stack_spec import NativeLayerSpec, NativeStackSpec, StackableModel
from tokenloom.profiler import PROFILER

logger = logging.getLogger("tokenloom.engine")


@dataclass(frozen=True)
class StackLoRA:
    """A step's LoRA adapters for the op: the model's slot stacks by (layer, target) (fixed once attached:
    loads copy into them), the per-slot scaling and each row's slot (-1: the base model)."""
    targets: dict[tuple[int, str], LoRATarget]
    scaling: torch.Tensor
    row_slots: torch.Tensor


class NativeStack:
    """The argument lists of `tokenloom::decoder_stack` for one loaded model, built once from its spec."""

    def __init__(self, spec: NativeStackSpec):
        layers = spec.layers
        first = layers[0]
        self.embed_tokens = spec.embed_tokens
        self.final_norm = spec.final_norm
        self.rotary_cos, self.rotary_sin = spec.rotary_cos, spec.rotary_sin
        self.weights: list[torch.Tensor] = []  # per layer: its two norms, then each linear's panels
        for layer in layers:
            self.weights += [layer.input_norm, layer.post_attention_norm]
            for w in layer.linears:
                self.weights += [w.panels.qpacked, w.panels.scales, w.panels.mins]
        self.qkv_biases: list[torch.Tensor | None] = [layer.qkv_bias for layer in layers]
        self.q_norms: list[torch.Tensor | None] = [layer.q_norm for layer in layers]
        self.k_norms: list[torch.Tensor | None] = [layer.k_norm for layer in layers]
        # Each layer's qkv, o, gate_up, down, layer after layer: read again each step for their int8 mode.
        self.linears: list[QuantizedWeight] = [w for layer in layers for w in layer.linears]
        self.windows = [layer.window for layer in layers]
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.eps = first.eps
        self.scale = first.scale
        self._modes: list[bool] | None = None
        self._layer_ints: list[int] = []
        self._lora_targets: dict[tuple[int, str], LoRATarget] | None = None
        self._lora_lists: tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[int]] = ([], [], [])

    def lora_lists(self, targets: dict[tuple[int, str], LoRATarget]
                   ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[int]]:
        """The op's per-layer LoRA lists (A stacks, B stacks, output columns; LORA_TARGETS' order), built once
        for the model's targets."""
        if targets is not self._lora_targets:
            a: list[torch.Tensor | None] = []
            b: list[torch.Tensor | None] = []
            columns: list[int] = []
            for layer in range(len(self.windows)):
                for name in LORA_TARGETS:
                    target = targets.get((layer, name))
                    a.append(None if target is None else target.a)
                    b.append(None if target is None else target.b)
                    columns.append(0 if target is None else target.column)
            self._lora_targets, self._lora_lists = targets, (a, b, columns)
        return self._lora_lists

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
        spec = _spec_or_reason(model, attention_backend_name)
        if isinstance(spec, str):
            logger.debug("steps run layer by layer: %s", spec)
            return None
        return cls(spec)

    @staticmethod
    def can_run() -> bool:
        return not PROFILER.enabled

    def op_args(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta,
                lora: StackLoRA | None = None) -> tuple:
        """`tokenloom::decoder_stack`'s arguments for one step (`meta`: NativeAttentionMetadata)."""
        lora_a, lora_b, lora_columns = self.lora_lists(lora.targets) if lora is not None else ([], [], [])
        return (self.embed_tokens(input_ids), positions, self.weights, self.layer_ints(), self.qkv_biases,
                self.q_norms, self.k_norms, self.final_norm, self.rotary_cos, self.rotary_sin, kv_caches,
                meta.slot_mapping, meta.num_decodes, meta.block_tables, meta.context_lens, meta.prefill_block_tables,
                meta.prefill_query_starts, meta.prefill_context_lens, self.num_heads, self.num_kv_heads,
                self.head_dim, self.eps, self.scale, lora_a, lora_b, lora_columns,
                None if lora is None else lora.scaling, None if lora is None else lora.row_slots)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta, lora: StackLoRA | None = None) -> torch.Tensor:
        """The final norm's output for the flat batch; `meta` is the native backend's NativeAttentionMetadata;
        `lora`: the step's adapters when some row uses one."""
        return torch.ops.tokenloom.decoder_stack(*self.op_args(input_ids, positions, kv_caches, meta, lora))


def _spec_or_reason(model, attention_backend_name: str) -> NativeStackSpec | str:
    """The model's spec when the op can run all of it, else why the steps run layer by layer."""
    if not kernels.enabled():
        return "the native kernels are off"
    if attention_backend_name != "native":
        return f"the {attention_backend_name} attention backend"
    if not isinstance(model, StackableModel):
        return f"{type(model).__name__} does not describe itself for the native stack"
    spec = model.native_stack_spec()
    if isinstance(spec, str):
        return spec
    return _beyond_the_op(spec) or spec


def _beyond_the_op(spec: NativeStackSpec) -> str | None:
    """What in a described model the op cannot run: it takes one shape, eps and scale for every layer, and
    runs SiLU-gated MLPs only."""
    if not spec.layers:
        return "no layers"
    first: NativeLayerSpec = spec.layers[0]
    for layer in spec.layers:
        if layer.activation != "silu":
            return f"the {layer.activation} activation"
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (first.num_heads, first.num_kv_heads,
                                                                     first.head_dim):
            return "head counts that differ between layers"
        if layer.scale != first.scale:
            return "attention scales that differ between layers"
        if layer.eps != spec.final_norm_eps:
            return "norm eps that differ between layers"
    return None
