"""The native decoder stack (tokenloom/model/native_stack.py, csrc/decoder_stack.cpp): a step in one native
call gives the layer-by-layer forward's hidden states and KV cache bit for bit, and the engine takes it only
where it may."""
from __future__ import annotations

import pytest
import torch

from helpers import greedy_params, random_prompts

pytestmark = pytest.mark.kernels

BLOCK = 16
PROMPTS = random_prompts(5, [3, 17, 40, 16, 29], vocab=49152, seed=3)


@pytest.fixture(scope="module")
def quantized(embedded_loaded):
    """The session's load of the embedded model: its weights kept quantized when the kernels load."""
    from tokenloom import kernels
    from tokenloom.model.layers.quantized_linear import quantized_weights
    if not kernels.load() or not quantized_weights(embedded_loaded.model):
        pytest.skip("native kernels not loaded (TOKENLOOM_KERNELS=off, or no build for this CPU)")
    return embedded_loaded


@torch.inference_mode()
def _prefilled(model, prompts, kv_dtype, extra: int = 0, fresh: list[list[int]] = ()):
    """Per-layer native KV caches holding each prompt (prefilled by the layer-by-layer forward), and a block
    table for each prompt (room for one decoded token and `extra` more) then for each of `fresh` (empty)."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    cfg, backend = model.config, NativeAttentionBackend()
    tables, next_block = [], 0
    for n in [len(p) + 1 + extra for p in prompts] + [len(f) for f in fresh]:
        blocks = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    shape = backend.kv_cache_shape(next_block, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(cfg.num_layers)]
    for p, table in zip(prompts, tables):
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))])
        meta = backend.build_metadata([ScheduledSpan(0, 0, len(p), table)], slots)
        model(torch.tensor(p), torch.arange(len(p)), caches, meta)
    return caches, tables


@torch.inference_mode()
def _step_both_ways(model, kv_dtype=torch.float32, new_chunks: tuple[int, ...] = ()):
    """One step, layer by layer and native, each on its own copy of the prefilled caches. With no
    `new_chunks`, a decode of every prompt; else a chunk of each length in `new_chunks`: the first starts a
    new sequence, the others continue the last prompts past their cached tokens, and the other prompts decode."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    fresh = [list(range(100, 100 + n)) for n in new_chunks[:1]]
    caches, tables = _prefilled(model, PROMPTS, kv_dtype, extra=max(new_chunks, default=0), fresh=fresh)
    spans, ids, pos, slots = [], [], [], []

    def add(table, start, tokens):
        spans.append(ScheduledSpan(len(ids), start, len(tokens), table))
        ids.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens)))

    decoding = len(PROMPTS) - max(len(new_chunks) - 1, 0)
    for p, t in zip(PROMPTS[:decoding], tables):
        add(t, len(p), [p[-1]])
    if fresh:
        add(tables[len(PROMPTS)], 0, fresh[0])
    for i, n in enumerate(new_chunks[1:], start=decoding):
        add(tables[i], len(PROMPTS[i]), list(range(7, 7 + n)))
    meta = NativeAttentionBackend().build_metadata(spans, torch.tensor(slots))
    ids, pos = torch.tensor(ids), torch.tensor(pos)
    eager_caches, native_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    eager = model(ids, pos, eager_caches, meta)
    native = NativeStack.build(model, "native").run(ids, pos, native_caches, meta)
    return eager, native, eager_caches, native_caches


def test_a_decode_step_matches_the_layer_by_layer_forward_bit_for_bit(quantized):
    eager, native, eager_caches, native_caches = _step_both_ways(quantized.model)
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


def test_a_step_with_decodes_a_new_prompt_and_continued_ones_matches_too(quantized):
    eager, native, eager_caches, native_caches = _step_both_ways(quantized.model, new_chunks=(21, 5, 33))
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


def test_a_prefill_only_step_matches_too(quantized):
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    cfg, backend = quantized.model.config, NativeAttentionBackend()
    prompt = PROMPTS[2]
    shape = backend.kv_cache_shape(len(prompt) // BLOCK + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(shape) for _ in range(cfg.num_layers)]
    table = list(range(shape[1]))
    meta = backend.build_metadata([ScheduledSpan(0, 0, len(prompt), table)], torch.arange(len(prompt)))
    with torch.inference_mode():
        eager = quantized.model(torch.tensor(prompt), torch.arange(len(prompt)), [c.clone() for c in caches], meta)
        native = NativeStack.build(quantized.model, "native").run(torch.tensor(prompt), torch.arange(len(prompt)),
                                                                  caches, meta)
    assert torch.equal(native, eager)


def test_the_w4a8_path_matches_too(quantized):
    from tokenloom.model.layers.quantized_linear import set_quantized_matmul
    try:
        set_quantized_matmul(quantized.model, "w4a8")
        eager, native, _, _ = _step_both_ways(quantized.model, torch.bfloat16, new_chunks=(19, 4))
    finally:
        set_quantized_matmul(quantized.model, "exact")
    assert torch.equal(native, eager)


def test_it_follows_a_weight_switched_to_w4a8_after_it_was_built(quantized):
    """set_quantized_matmul flips loaded weights in place; the stack reads their path every step."""
    from tokenloom.model.layers.quantized_linear import set_quantized_matmul
    from tokenloom.model.native_stack import NativeStack
    stack = NativeStack.build(quantized.model, "native")
    exact_ints = list(stack.layer_ints())
    try:
        set_quantized_matmul(quantized.model, "w4a8")
        w4a8_ints = stack.layer_ints()
    finally:
        set_quantized_matmul(quantized.model, "exact")
    assert exact_ints[4] == 0 and w4a8_ints[4] == 1  # layer 0's qkv: (columns, bits, block, int8 activations)
    assert w4a8_ints[:4] == exact_ints[:4]


def test_the_step_profiler_keeps_the_layer_by_layer_forward():
    """--profile times the layers' ops apart, which one native call cannot."""
    from tokenloom.model.native_stack import NativeStack
    from tokenloom.profiler import PROFILER
    assert NativeStack.can_run()
    PROFILER.enabled = True
    try:
        assert not NativeStack.can_run()
    finally:
        PROFILER.enabled = False


def test_the_engine_runs_the_embedded_model_through_it(make_llm, quantized):
    llm = make_llm()
    assert llm.engine.executor.worker.runner.native_stack is not None


def test_enforce_eager_keeps_the_layer_by_layer_forward(make_llm):
    assert make_llm(enforce_eager=True).engine.executor.worker.runner.native_stack is None


def test_greedy_output_is_the_same_with_and_without_it(make_llm):
    params = greedy_params(max_tokens=12)
    fast = make_llm().generate(PROMPTS, params, use_tqdm=False)
    eager = make_llm(enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in eager]


def test_a_dense_model_takes_the_eager_forward(make_core):
    assert make_core("llama").executor.worker.runner.native_stack is None


def test_the_op_fake_implementation_agrees_with_the_kernel(quantized):
    """Schema (the KV caches the only inputs written) and fake tensor: the op can sit in a compiled graph."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    model = quantized.model
    caches, tables = _prefilled(model, PROMPTS[:2], torch.float32)
    spans = [ScheduledSpan(i, len(p), 1, t) for i, (p, t) in enumerate(zip(PROMPTS[:2], tables))]
    slots = torch.tensor([t[len(p) // BLOCK] * BLOCK + len(p) % BLOCK for p, t in zip(PROMPTS[:2], tables)])
    meta = NativeAttentionBackend().build_metadata(spans, slots)
    stack = NativeStack.build(model, "native")
    with torch.inference_mode():
        embeddings = stack.embed_tokens(torch.tensor([p[-1] for p in PROMPTS[:2]]))
    args = (embeddings, torch.tensor([len(p) for p in PROMPTS[:2]]), stack.weights, stack.layer_ints(),
            stack.final_norm.weight, stack.rotary.cos, stack.rotary.sin, caches, meta.slot_mapping, meta.num_decodes,
            meta.block_tables, meta.context_lens, None, None, None, stack.num_heads, stack.num_kv_heads,
            stack.head_dim, stack.eps, stack.scale)
    torch.library.opcheck(torch.ops.tokenloom.decoder_stack.default, args, test_utils=("test_schema", "test_faketensor"))
