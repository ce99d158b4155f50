"""Linear weights prepacked for oneDNN on CPU: same results as the dense weights, packed once at start-up."""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom.config import CacheConfig, EngineConfig, ModelConfig
from tokenloom.model.layers.linear import Linear, mixed_linear
from tokenloom.model.loader import load_model
from tokenloom.model.matmul_dtype import cast_matmul_weights
from tokenloom.model.prepack import can_prepack, pack_weight, prepack_linear_weights
from tokenloom.worker.worker import build_worker

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu")), reason="this torch build has no oneDNN")


def test_a_packed_weight_multiplies_like_the_dense_one_with_bias_and_mixed_dtypes():
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 64), torch.randn(48, 64), torch.randn(48)
    packed = pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    torch.testing.assert_close(mixed_linear(x, packed, b), torch.nn.functional.linear(x, w, b))
    got = mixed_linear(x, pack_weight(w.bfloat16()), b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, mixed_linear(x, w.bfloat16(), b), rtol=1e-2, atol=1e-2)


def test_a_weight_onednn_cannot_pack_stays_dense_and_still_multiplies():
    """float16 packing needs AVX-NE-CONVERT or AVX512-FP16; without them the weight is left as it is."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 32), torch.randn(16, 32).half()
    weight = pack_weight(w)
    assert weight.is_mkldnn or weight is w  # packed, or handed back untouched
    torch.testing.assert_close(mixed_linear(x, weight), x.half().float() @ w.float().T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["llama_tied_gqa", "qwen2"])
@pytest.mark.parametrize("matmul_dtype", [torch.float32, torch.bfloat16])
def test_prepacking_a_model_keeps_its_logits(tiny_models, kind, matmul_dtype):
    folder, _ = tiny_models(kind)
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    cast_matmul_weights(model, matmul_dtype)
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 8]]
    dense = helpers.last_logits(model, prompts)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert prepack_linear_weights(model) == len(linears) + (model.lm_head is None)
    assert all(m.weight.is_mkldnn and m.weight.dtype == matmul_dtype for m in linears)
    assert model.head_weight().is_mkldnn
    assert not model.model.embed_tokens.weight.is_mkldnn  # the lookup still reads the dense table
    tol = 1e-5 if matmul_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(helpers.last_logits(model, prompts), dense, rtol=tol, atol=tol)
    assert prepack_linear_weights(model) == 0  # packed once


def test_the_engine_prepacks_on_cpu(tiny_models):
    folder, _ = tiny_models("llama_tied_gqa")
    config = EngineConfig(model=ModelConfig(model=folder, device="cpu"), cache=CacheConfig(num_blocks=16))
    model = build_worker(config, progress=False).loaded.model
    assert all(m.weight.is_mkldnn for m in model.modules() if isinstance(m, Linear))
    assert model.head_weight().is_mkldnn
