"""The native decoder stack (tokenloom/model/native_decode.py, csrc/decoder_stack.cpp): a decode-only step in
one native call gives the layer-by-layer forward's hidden states and KV cache bit for bit, and the engine
takes it only where it may."""
from __future__ import annotations

import pytest
import torch

from helpers import greedy_params, random_prompts

pytestmark = pytest.mark.kernels

BLOCK = 16
PROMPTS = random_prompts(5, [3, 17, 40, 16, 29], vocab=49152, seed=3)


@pytest.fixture(scope="module")
def quantized(embedded_path):
    from tokenloom import kernels
    if not kernels.load():
        pytest.skip("native kernels not loaded (TOKENLOOM_KERNELS=off, or no build for this CPU)")
    from tokenloom.model.loader import load_model
    return load_model(embedded_path, torch.float32, torch.device("cpu"), progress=False, quantized=True)


@torch.inference_mode()
def _prefilled(model, prompts, kv_dtype):
    """Per-layer native KV caches holding each prompt (prefilled by the eager forward), and the tables."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    cfg, backend = model.config, NativeAttentionBackend()
    tables, next_block = [], 0
    for p in prompts:
        n = len(p) // BLOCK + 1  # room for the decoded token
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    shape = backend.kv_cache_shape(next_block, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(cfg.num_layers)]
    for p, table in zip(prompts, tables):
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))])
        meta = backend.build_metadata([ScheduledSpan(0, 0, len(p), table)], slots)
        model(torch.tensor(p), torch.arange(len(p)), caches, meta)
    return caches, tables


@torch.inference_mode()
def _decode_both_ways(model, kv_dtype=torch.float32):
    """One decode step of every prompt, eager and native, each on its own copy of the prefilled caches."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_decode import NativeDecode
    caches, tables = _prefilled(model, PROMPTS, kv_dtype)
    spans = [ScheduledSpan(i, len(p), 1, t) for i, (p, t) in enumerate(zip(PROMPTS, tables))]
    slots = torch.tensor([t[len(p) // BLOCK] * BLOCK + len(p) % BLOCK for p, t in zip(PROMPTS, tables)])
    meta = NativeAttentionBackend().build_metadata(spans, slots)
    ids, pos = torch.tensor([p[-1] for p in PROMPTS]), torch.tensor([len(p) for p in PROMPTS])
    eager_caches, native_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    eager = model(ids, pos, eager_caches, meta)
    native = NativeDecode.build(model, "native").run(ids, pos, native_caches, meta)
    return eager, native, eager_caches, native_caches


def test_a_decode_step_matches_the_layer_by_layer_forward_bit_for_bit(quantized):
    eager, native, eager_caches, native_caches = _decode_both_ways(quantized.model)
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


def test_the_w4a8_path_matches_too(quantized):
    from tokenloom.model.layers.quantized_linear import set_quantized_matmul
    try:
        set_quantized_matmul(quantized.model, "w4a8")
        eager, native, _, _ = _decode_both_ways(quantized.model, torch.bfloat16)
    finally:
        set_quantized_matmul(quantized.model, "exact")
    assert torch.equal(native, eager)


def test_it_follows_a_weight_switched_to_w4a8_after_it_was_built(quantized):
    """set_quantized_matmul flips loaded weights in place; the stack reads their path every step."""
    from tokenloom.model.layers.quantized_linear import set_quantized_matmul
    from tokenloom.model.native_decode import NativeDecode
    stack = NativeDecode.build(quantized.model, "native")
    exact_ints = list(stack.layer_ints())
    try:
        set_quantized_matmul(quantized.model, "w4a8")
        w4a8_ints = stack.layer_ints()
    finally:
        set_quantized_matmul(quantized.model, "exact")
    assert exact_ints[4] == 0 and w4a8_ints[4] == 1  # layer 0's qkv: (columns, bits, block, int8 activations)
    assert w4a8_ints[:4] == exact_ints[:4]


def test_steps_with_a_prefill_chunk_take_the_eager_forward():
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.native_decode import NativeDecode
    assert NativeDecode.can_run([ScheduledSpan(0, 9, 1, [0]), ScheduledSpan(1, 4, 1, [1])])
    assert not NativeDecode.can_run([ScheduledSpan(0, 9, 1, [0]), ScheduledSpan(1, 0, 5, [1])])


def test_the_engine_decodes_the_embedded_model_through_it(make_llm):
    llm = make_llm()
    assert llm.engine.executor.worker.runner.native_decode is not None


def test_enforce_eager_keeps_the_layer_by_layer_forward(make_llm):
    assert make_llm(enforce_eager=True).engine.executor.worker.runner.native_decode is None


def test_greedy_output_is_the_same_with_and_without_it(make_llm):
    params = greedy_params(max_tokens=24)
    fast = make_llm().generate(PROMPTS, params, use_tqdm=False)
    eager = make_llm(enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in eager]


def test_a_dense_model_takes_the_eager_forward(make_core):
    assert make_core("llama").executor.worker.runner.native_decode is None
