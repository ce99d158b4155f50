"""What a decoder model tells the native stack about itself (tokenloom/model/native_stack.py).

The stack runs a whole step in one native call (`tokenloom::decoder_stack`), so it needs each layer's
weights as tensors and its shape as numbers. A model that can be stacked describes itself in these
terms (`native_stack_spec()`), or says in a few words why it cannot; the stack never reads a model's
modules. So a model whose layers change keeps the stack right by changing its own description, and a
new architecture takes the stack by describing itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from tokenloom.model.layers.norm import RMSNorm
from tokenloom.model.layers.quantized_weight import QuantizedWeight


@dataclass(frozen=True)
class NativeLayerSpec:
    """One decoder layer as the stack runs it: pre-norm attention then a gated MLP, each behind an RMSNorm
    whose residual add is fused with the next norm (tokenloom/model/models/llama.py `DecoderLayer`)."""
    input_norm: torch.Tensor           # float32 [hidden]
    post_attention_norm: torch.Tensor  # float32 [hidden]
    qkv: QuantizedWeight               # in the interleaved panels; q rows, then k, then v
    o: QuantizedWeight
    gate_up: QuantizedWeight           # gate rows, then up rows
    down: QuantizedWeight
    qkv_bias: torch.Tensor | None      # added to the qkv projection's output (Qwen2)
    q_norm: torch.Tensor | None        # float32 [head_dim], RMSNorm of each query head before rotary (Qwen3)
    k_norm: torch.Tensor | None        # the same for each key head; present exactly when q_norm is
    window: int                        # sliding window of the attention, 0 for the whole context
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float                         # of every norm in the layer
    scale: float                       # the attention's softmax scale
    activation: str                    # the MLP gate's activation (HF name)

    @property
    def linears(self) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight, QuantizedWeight]:
        """The four projections in the order the layer runs them."""
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True)
class NativeStackSpec:
    """A whole decoder: embedding lookup, its layers in order, the final norm."""
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # token ids -> float32 [tokens, hidden]
    layers: tuple[NativeLayerSpec, ...]
    final_norm: torch.Tensor  # float32 [hidden]
    final_norm_eps: float
    rotary_cos: torch.Tensor  # float32 [max_positions, head_dim / 2], shared by every layer
    rotary_sin: torch.Tensor


@runtime_checkable
class StackableModel(Protocol):
    def native_stack_spec(self) -> NativeStackSpec | str:
        """This model for the native stack, or why it cannot run there."""


def float32_rms_norm(norm: nn.Module) -> torch.Tensor | None:
    """The weight of a plain float32 RMSNorm (the native `rms_norm` op's form), None for any other norm
    (Gemma's (1 + weight) RMSNorm is a subclass that computes differently)."""
    if type(norm) is not RMSNorm or norm.weight.dtype != torch.float32:
        return None
    return norm.weight.data


def panelled_weight(linear: nn.Module) -> QuantizedWeight | None:
    """A linear layer's weight when it is quantized in the interleaved panels (what `quant_gemm` reads),
    None when it is dense or still row-major."""
    weight = linear.weight
    if not isinstance(weight, QuantizedWeight) or weight.panels is None:
        return None
    return weight
