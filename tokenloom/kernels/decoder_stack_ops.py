"""The whole-stack decode op (csrc/decoder_stack.cpp): its fake. Its reference is the model itself.

- `decoder_stack_decode(embeddings, positions, weights, layer_ints, final_norm, cos, sin, kv_caches,
  slot_mapping, block_tables, context_lens, num_heads, num_kv_heads, head_dim, eps, scale)` -> the final
  norm's output [tokens, hidden]: a decode-only step of a Llama-family decoder (the native ops of each layer
  in the order `tokenloom/model/models/llama.py` calls them), writing each layer's new K/V into its cache.
  The reference is that layer-by-layer forward: tests/unit/test_native_decode.py compares the two bit for bit.
  tokenloom/model/native_decode.py builds the argument lists and decides when the op may run.
"""
from __future__ import annotations

import torch

from tokenloom import kernels


def _register_fakes() -> None:
    @torch.library.register_fake("tokenloom::decoder_stack_decode")
    def _decoder_stack_decode(embeddings, positions, weights, layer_ints, final_norm, cos, sin, kv_caches,
                              slot_mapping, block_tables, context_lens, num_heads, num_kv_heads, head_dim, eps,
                              scale):
        return torch.empty_like(embeddings, memory_format=torch.contiguous_format)


if kernels.load():
    _register_fakes()
