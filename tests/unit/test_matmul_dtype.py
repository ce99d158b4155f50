"""Reduced-precision matmul weights under float32 activations (--matmul-dtype)."""
from __future__ import annotations

import os

import helpers
import pytest
import torch

from tokenloom.config import ConfigError, ModelConfig
from tokenloom.model.layers.linear import Linear, mixed_linear
from tokenloom.model.loader import load_model
from tokenloom.model.matmul_dtype import cast_matmul_weights, native_cpu_matmul


def test_unknown_matmul_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="matmul_dtype must be one of"):
        ModelConfig(matmul_dtype="int3")


def test_mixed_linear_rounds_inputs_to_the_weight_dtype_and_adds_the_bias_in_float32():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(32, 64).bfloat16(), torch.randn(32)
    got = mixed_linear(x, w, b)
    want = x.bfloat16().float() @ w.float().T + b
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bfloat16 GEMMs round their output


def test_mixed_linear_is_plain_linear_when_dtypes_agree():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(mixed_linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("kind", ["llama_tied_gqa", "qwen2"])
def test_bfloat16_matmuls_keep_logits_close_to_float32(tiny_models, kind):
    folder, _ = tiny_models(kind)
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 8]]
    exact = helpers.last_logits(model, prompts)
    cast_matmul_weights(model, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert all(m.bias is None or m.bias.dtype == torch.float32 for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the lookup stays exact
    assert model.head_weight().dtype == torch.bfloat16
    fast = helpers.last_logits(model, prompts)
    assert fast.dtype == torch.float32
    relative = ((fast - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    assert 0 < relative < 0.02


def test_float32_counts_as_native_everywhere_and_reduced_precision_follows_the_cpu_flags():
    assert native_cpu_matmul(torch.float32)
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("platform: no /proc/cpuinfo on this OS")
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    assert native_cpu_matmul(torch.bfloat16) == bool(flags & {"avx512_bf16", "amx_bf16"})
