"""The fused layer ops (RMSNorm, residual-add + RMSNorm, rotary, SiLU-and-multiply) against the model's own
torch path, and a tiny model decoding the same tokens on the native and torch attention backends."""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom.kernels import layer_ops

pytestmark = pytest.mark.kernels

OPCHECK = ("test_schema", "test_faketensor")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("shape", [(1, 576), (7, 33), (3, 4, 18)], ids=str)
def test_rms_norm_matches_the_reference(shape):
    x, w = _randn(*shape), _randn(shape[-1], seed=1)
    torch.testing.assert_close(torch.ops.tokenloom.rms_norm(x, w, 1e-5), layer_ops.rms_norm_reference(x, w, 1e-5),
                               rtol=1e-5, atol=1e-6)


def test_rms_norm_of_a_strided_view_normalises_each_head():
    """Qwen3's per-head query norm gets a view into the fused QKV output."""
    qkv = _randn(5, 3 * 64 + 64)
    q, w = qkv[:, :192].view(5, 3, 64), _randn(64, seed=2)
    torch.testing.assert_close(torch.ops.tokenloom.rms_norm(q, w, 1e-6), layer_ops.rms_norm_reference(q, w, 1e-6),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,width", [(1, 576), (33, 100)])
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(rows, width):
    x, r, w = _randn(rows, width), _randn(rows, width, seed=1, scale=30), _randn(width, seed=2)
    normed, total = torch.ops.tokenloom.add_rms_norm(x, r, w, 1e-5)
    want_normed, want_total = layer_ops.add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 18])
def test_rotary_on_views_into_the_fused_projection_matches_the_reference(head_dim):
    heads, kv_heads, tokens = 5, 1, 6
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.outer(torch.arange(4096.0), _randn(head_dim // 2, seed=3).abs())
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 1, 2, 900, 4095, 17])
    got = torch.ops.tokenloom.rotary_embedding(positions, q, k, cos, sin)
    want = layer_ops.rotary_embedding_reference(positions, q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_rotary_refuses_a_position_past_its_table():
    q, k, table = _randn(1, 2, 8), _randn(1, 1, 8), torch.ones(10, 4)
    with pytest.raises(RuntimeError, match="outside the table"):
        torch.ops.tokenloom.rotary_embedding(torch.tensor([10]), q, k, table, table)


@pytest.mark.parametrize("rows,width", [(1, 1536), (9, 37)])
def test_silu_and_mul_matches_the_reference_including_saturated_gates(rows, width):
    x = _randn(rows, 2 * width, scale=40)  # gates far into both tails of the sigmoid
    torch.testing.assert_close(torch.ops.tokenloom.silu_and_mul(x), layer_ops.silu_and_mul_reference(x),
                               rtol=1e-5, atol=1e-5)


def test_the_ops_fake_implementations_agree_with_the_kernels():
    x, w = _randn(3, 40), _randn(40, seed=1)
    torch.library.opcheck(torch.ops.tokenloom.rms_norm.default, (x, w, 1e-5), test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.tokenloom.add_rms_norm.default, (x, x.clone(), w, 1e-5), test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.tokenloom.silu_and_mul.default, (x,), test_utils=OPCHECK)
    q, k, table = _randn(2, 3, 8), _randn(2, 1, 8), _randn(16, 4)
    torch.library.opcheck(torch.ops.tokenloom.rotary_embedding.default, (torch.tensor([0, 5]), q, k, table, table),
                          test_utils=OPCHECK)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8"])
def test_a_tiny_model_decodes_the_same_tokens_on_the_native_and_torch_backends(make_core, kv_cache_dtype):
    prompts = helpers.random_prompts(5, [3, 17, 40, 1, 70], vocab=200, seed=9)
    tokens = {}
    for backend in ("native", "torch"):
        core = make_core("llama", attention_backend=backend, kv_cache_dtype=kv_cache_dtype, block_size=16)
        tokens[backend] = helpers.generate_tokens(core, prompts, helpers.greedy_params(max_tokens=24), prefix=backend)
    assert tokens["native"] == tokens["torch"]
