"""Reduced-precision matmul weights under full-precision activations.

On CPUs with native bfloat16 dot products (AVX512-BF16, AMX) a bfloat16 GEMM
runs over twice as fast as float32 at every batch size, and a large GEMV reads
half the bytes. Converting only the linear layers' weights (and the output
head) keeps the residual stream, norms, rotary, attention, KV cache, logits and
sampling in the model dtype, which bounds the error to one rounding of each
weight and each matmul input.
"""
from __future__ import annotations

import torch

from tokenloom.model.layers.fused_moe import FusedMoE
from tokenloom.model.layers.linear import Linear


def cast_matmul_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every Linear weight (and a tied output head) in ``dtype``; returns the bytes the weights now take."""
    for module in model.modules():
        if isinstance(module, (Linear, FusedMoE)):
            module.method.cast(module, dtype)
    if has_tied_head(model):  # the lookup keeps full precision
        model.tied_head_weight = model.model.embed_tokens.weight.data.to(dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def has_tied_head(model: torch.nn.Module) -> bool:
    """Whether the output head multiplies by the input embedding (kept apart in ``tied_head_weight``)."""
    return hasattr(model, "tied_head_weight") and model.lm_head is None


def native_cpu_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (otherwise oneDNN emulates it, slower than float32)."""
    if dtype not in _NATIVE_FLAGS:
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return any(flag in flags for flag in _NATIVE_FLAGS[dtype])
