"""The whole-stack op (csrc/decoder_stack.cpp): its fake. Its reference is the model itself.

- `decoder_stack(embeddings, positions, weights, layer_ints, qkv_biases, q_norms, k_norms, final_norm, cos, sin,
  kv_caches, slot_mapping, num_decodes, decode_tables, decode_lens, prefill_tables, prefill_starts, prefill_lens,
  num_heads, num_kv_heads, head_dim, eps, scale, lora_a, lora_b, lora_columns, lora_scaling, lora_row_slots)`
  -> the final norm's output [tokens, hidden]: one step of a
  Llama-family decoder over a flat batch of decodes then prefill chunks (the native ops of each layer in
  the order `tokenloom/model/models/llama.py` and the native attention backend call them), writing each
  layer's new K/V into its cache. `qkv_biases`, `q_norms`, `k_norms` hold one optional tensor a layer: the
  bias added to the qkv projection (Qwen2) and the per-head q/k RMSNorm weights (Qwen3). With `lora_row_slots`,
  each linear adds its rows' LoRA deltas (`lora_add`, after its bias) from `lora_a`/`lora_b`, seven optional slot
  stacks a layer (q, k, v, o, gate, up, down) written at `lora_columns` of the fused output. The reference is
  that layer-by-layer forward: tests/unit/test_native_stack.py compares the two bit for bit.
  tokenloom/model/native_stack.py builds the argument lists from the model's spec and decides when the op
  may run.
"""
from __future__ import annotations

import torch

from tokenloom import kernels


def _register_fakes() -> None:
    @torch.library.register_fake("tokenloom::decoder_stack")
    def _decoder_stack(embeddings, positions, weights, layer_ints, qkv_biases, q_norms, k_norms, final_norm, cos, sin,
                       kv_caches, slot_mapping, num_decodes, decode_tables, decode_lens, prefill_tables, prefill_starts,
                       prefill_lens, num_heads, num_kv_heads, head_dim, eps, scale, lora_a, lora_b, lora_columns,
                       lora_scaling, lora_row_slots):
        return torch.empty_like(embeddings, memory_format=torch.contiguous_format)


if kernels.load():
    _register_fakes()
