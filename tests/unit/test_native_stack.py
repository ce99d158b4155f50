"""The native decoder stack (tokenloom/model/native_stack.py, csrc/decoder_stack.cpp): a step in one native
call gives the layer-by-layer forward's hidden states and KV cache bit for bit, and the engine takes it only
where it may.

Beside the embedded model (Llama), tiny random Llama, Mistral (with a sliding window shorter than the
prompts), Qwen2 (qkv biases) and Qwen3 (q/k norms) models, written as GGUF files with Q4_0 and Q8_0 weights,
check each architecture's variant of the op against its own layer-by-layer forward.
"""
from __future__ import annotations

from dataclasses import replace

import helpers
import pytest
import torch
from helpers import greedy_params, random_prompts

pytestmark = pytest.mark.kernels

BLOCK = 16
PROMPTS = random_prompts(5, [3, 17, 40, 16, 29], vocab=49152, seed=3)
TINY_PROMPTS = random_prompts(5, [3, 17, 40, 16, 29], vocab=512, seed=3)
ARCHITECTURES = list(helpers.TINY_GGUF_ARCH)
# Both weight widths the kernels take, and a merged qkv of 4-bit q/k with 8-bit v (widened to 8 bits on load).
TINY_STORAGE = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_0", "attn_v.weight": "Q8_0",
                "attn_output.weight": "Q4_0", "ffn_gate.weight": "Q8_0", "ffn_up.weight": "Q8_0",
                "ffn_down.weight": "Q4_0", "token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
MISTRAL_WINDOW = 12  # shorter than most of TINY_PROMPTS, so the window changes what their rows attend


@pytest.fixture(scope="module")
def quantized(embedded_loaded):
    """The session's load of the embedded model: its weights kept quantized when the kernels load."""
    from tokenloom.model.layers.quantized_linear import quantized_weights
    assert quantized_weights(embedded_loaded.model), "the kernels loaded but the weights were not kept quantized"
    return embedded_loaded


@pytest.fixture(scope="module")
def tiny_quantized(tiny_models, tmp_path_factory):
    """``tiny_quantized(kind) -> model``: a tiny random model of `kind` loaded from a GGUF file of its
    weights, kept quantized (native kernels)."""
    from tokenloom.model.loader import load_model
    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            path = str(tmp_path_factory.mktemp("native_stack_gguf") / f"{kind}.gguf")
            window = MISTRAL_WINDOW if kind == "mistral" else None
            helpers.write_tiny_gguf(tiny_models(kind)[1], kind, path, TINY_STORAGE, sliding_window=window)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TOKENLOOM_WEIGHT_CACHE", "0")
                loaded[kind] = load_model(path, torch.float32, torch.device("cpu"), progress=False).model
        return loaded[kind]

    return get


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
def _step_both_ways(model, kv_dtype=torch.float32, new_chunks: tuple[int, ...] = (), prompts=PROMPTS, lora=None):
    """One step, layer by layer and native, each on its own copy of the prefilled caches. With no
    `new_chunks`, a decode of every prompt; else a chunk of each length in `new_chunks`: the first starts a
    new sequence, the others continue the last prompts past their cached tokens, and the other prompts decode.
    `lora` (attach_lora's ModelLoRA): the rows take slots -1, 0, 1, 2 in turn."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    fresh = [list(range(100, 100 + n)) for n in new_chunks[:1]]
    caches, tables = _prefilled(model, prompts, kv_dtype, extra=max(new_chunks, default=0), fresh=fresh)
    spans, ids, pos, slots = [], [], [], []

    def add(table, start, tokens):
        spans.append(ScheduledSpan(len(ids), start, len(tokens), table))
        ids.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens)))

    decoding = len(prompts) - max(len(new_chunks) - 1, 0)
    for p, t in zip(prompts[:decoding], tables):
        add(t, len(p), [p[-1]])
    if fresh:
        add(tables[len(prompts)], 0, fresh[0])
    for i, n in enumerate(new_chunks[1:], start=decoding):
        add(tables[i], len(prompts[i]), list(range(7, 7 + n)))
    meta = NativeAttentionBackend().build_metadata(spans, torch.tensor(slots))
    ids, pos = torch.tensor(ids), torch.tensor(pos)
    eager_caches, native_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    stack_lora = None
    if lora is not None:
        from tokenloom.model.native_stack import StackLoRA
        lora.batch.row_slots = torch.tensor([(-1, 0, 1, 2)[i % 4] for i in range(len(ids))], dtype=torch.int32)
        stack_lora = StackLoRA(lora.targets, lora.batch.scaling, lora.batch.row_slots)
    try:
        eager = model(ids, pos, eager_caches, meta)
    finally:
        if lora is not None:
            lora.batch.row_slots = None
    native = NativeStack.build(model, "native").run(ids, pos, native_caches, meta, stack_lora)
    return eager, native, eager_caches, native_caches


def test_a_decode_step_matches_the_layer_by_layer_forward_bit_for_bit(quantized):
    eager, native, eager_caches, native_caches = _step_both_ways(quantized.model)
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=str)
def random_lora(quantized, request):
    """Three LoRA slots of rank 8 on every target of the session's model, random A and B, in float32 and in
    bfloat16 slots (--lora-dtype); detached after."""
    from tokenloom.lora.layer import LoRALayer
    from tokenloom.model.lora_slots import attach_lora
    model = quantized.model
    lora = attach_lora(model, model.config, num_slots=3, max_rank=8, device=torch.device("cpu"), dtype=request.param)
    g = torch.Generator().manual_seed(0)
    for target in lora.targets.values():
        target.a.copy_(torch.randn(target.a.shape, generator=g) * 0.05)
        target.b.copy_(torch.randn(target.b.shape, generator=g) * 0.05)
    lora.batch.scaling.copy_(torch.tensor([2.0, 0.5, 1.0]))
    yield lora
    for module in model.modules():
        if isinstance(getattr(module, "lora", None), LoRALayer):
            module.lora = None


def test_a_step_with_lora_rows_matches_the_layer_by_layer_forward_with_the_torch_op(quantized, random_lora):
    """Decodes, a new prompt and continued ones, their rows on three adapters and the base model, in one call."""
    eager, native, eager_caches, native_caches = _step_both_ways(quantized.model, new_chunks=(21, 5, 33),
                                                                 lora=random_lora)
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))
    _, base, _, _ = _step_both_ways(quantized.model, new_chunks=(21, 5, 33))
    assert not torch.allclose(native[1::4], base[1::4], atol=1e-3)  # the adapters' rows did change


def test_a_step_with_decodes_a_new_prompt_and_continued_ones_matches_too(quantized):
    eager, native, eager_caches, native_caches = _step_both_ways(quantized.model, new_chunks=(21, 5, 33))
    assert torch.equal(native, eager)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


@torch.inference_mode()
def _prefill_both_ways(model, prompt):
    """One step that is a single fresh prompt, layer by layer and native, each on its own empty caches."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    cfg, backend = model.config, NativeAttentionBackend()
    shape = backend.kv_cache_shape(len(prompt) // BLOCK + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    eager_caches = [torch.zeros(shape) for _ in range(cfg.num_layers)]
    native_caches = [torch.zeros(shape) for _ in range(cfg.num_layers)]
    table = list(range(shape[1]))
    meta = backend.build_metadata([ScheduledSpan(0, 0, len(prompt), table)], torch.arange(len(prompt)))
    eager = model(torch.tensor(prompt), torch.arange(len(prompt)), eager_caches, meta)
    native = NativeStack.build(model, "native").run(torch.tensor(prompt), torch.arange(len(prompt)), native_caches,
                                                    meta)
    return eager, native, eager_caches, native_caches


def test_a_prefill_only_step_matches_too(quantized):
    eager, native, _, _ = _prefill_both_ways(quantized.model, PROMPTS[2])
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
    assert llm.engine.executor.worker.runner.forward.kind == "native_stack"


def test_enforce_eager_keeps_the_layer_by_layer_forward(make_llm):
    assert make_llm(enforce_eager=True).engine.executor.worker.runner.forward.kind == "eager"


def test_greedy_output_is_the_same_with_and_without_it(make_llm):
    params = greedy_params(max_tokens=12)
    fast = make_llm().generate(PROMPTS, params, use_tqdm=False)
    eager = make_llm(enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in eager]


def test_a_dense_model_takes_the_eager_forward(make_core):
    assert make_core("llama").executor.worker.runner.forward.kind == "eager"


def _opcheck(model, prompts) -> None:
    """Schema (the KV caches the only inputs written) and fake tensor: the op can sit in a compiled graph."""
    from tokenloom.model.layers.attention_backend import ScheduledSpan
    from tokenloom.model.layers.attention_native import NativeAttentionBackend
    from tokenloom.model.native_stack import NativeStack
    caches, tables = _prefilled(model, prompts, torch.float32)
    spans = [ScheduledSpan(i, len(p), 1, t) for i, (p, t) in enumerate(zip(prompts, tables))]
    slots = torch.tensor([t[len(p) // BLOCK] * BLOCK + len(p) % BLOCK for p, t in zip(prompts, tables)])
    meta = NativeAttentionBackend().build_metadata(spans, slots)
    stack = NativeStack.build(model, "native")
    with torch.inference_mode():
        args = stack.op_args(torch.tensor([p[-1] for p in prompts]), torch.tensor([len(p) for p in prompts]),
                             caches, meta)
    torch.library.opcheck(torch.ops.tokenloom.decoder_stack.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_the_op_fake_implementation_agrees_with_the_kernel(quantized):
    _opcheck(quantized.model, PROMPTS[:2])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_op_fake_agrees_with_biases_and_qk_norms_too(kind, tiny_quantized):
    _opcheck(tiny_quantized(kind), TINY_PROMPTS[:2])


# ---- every Llama-family architecture ---------------------------------------------------------------------

def _same(eager, native, eager_caches, native_caches) -> bool:
    return torch.equal(native, eager) and all(torch.equal(a, b) for a, b in zip(native_caches, eager_caches))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_takes_the_stack_with_what_its_layers_need(kind, tiny_quantized):
    from tokenloom.model.native_stack import NativeStack
    model = tiny_quantized(kind)
    spec = model.native_stack_spec()
    assert not isinstance(spec, str), spec
    layer = spec.layers[0]
    assert (layer.qkv_bias is not None) == (kind == "qwen2")
    assert (layer.q_norm is not None) == (layer.k_norm is not None) == (kind == "qwen3")
    assert layer.window == (MISTRAL_WINDOW if kind == "mistral" else 0)
    assert {w.bits for w in layer.linears} == {4, 8}
    assert NativeStack.build(model, "native") is not None


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_decodes_bit_for_bit(kind, tiny_quantized):
    assert _same(*_step_both_ways(tiny_quantized(kind), prompts=TINY_PROMPTS))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_runs_a_mixed_step_bit_for_bit(kind, tiny_quantized):
    assert _same(*_step_both_ways(tiny_quantized(kind), new_chunks=(21, 5, 33), prompts=TINY_PROMPTS))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_prefills_bit_for_bit(kind, tiny_quantized):
    assert _same(*_prefill_both_ways(tiny_quantized(kind), TINY_PROMPTS[2]))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_w4a8_path_matches_with_biases_and_qk_norms_too(kind, tiny_quantized):
    from tokenloom.model.layers.quantized_linear import set_quantized_matmul
    model = tiny_quantized(kind)
    try:
        set_quantized_matmul(model, "w4a8")
        eager, native, _, _ = _step_both_ways(model, torch.bfloat16, new_chunks=(19, 4), prompts=TINY_PROMPTS)
    finally:
        set_quantized_matmul(model, "exact")
    assert torch.equal(native, eager)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_a_model_with_dense_weights_says_so(kind, make_core):
    """The tiny safetensors folders load dense: each architecture's spec names the reason."""
    runner = make_core(kind).executor.worker.runner
    reason = runner.model.native_stack_spec()
    assert reason == "layer 0: weights not in the quantized panels (dense or unquantized)"
    assert runner.forward.kind == "eager"


class _Described:
    """A model that describes itself as `spec` (the op's own limits are the stack's to check)."""

    def __init__(self, spec):
        self.spec = spec

    def native_stack_spec(self):
        return self.spec


def _with_layer(spec, index: int, **changes):
    layers = list(spec.layers)
    layers[index] = replace(layers[index], **changes)
    return replace(spec, layers=tuple(layers))


def test_the_stack_refuses_what_its_op_cannot_run_and_says_why(tiny_quantized, caplog):
    from tokenloom.model.native_stack import NativeStack
    model = tiny_quantized("llama")
    spec = model.native_stack_spec()
    cases = {
        "the gelu_pytorch_tanh activation": _Described(_with_layer(spec, 1, activation="gelu_pytorch_tanh")),
        "attention scales that differ between layers": _Described(_with_layer(spec, 1, scale=0.5)),
        "norm eps that differ between layers": _Described(_with_layer(spec, 0, eps=1e-3)),
        "head counts that differ between layers": _Described(_with_layer(spec, 1, num_kv_heads=1)),
        "no layers": _Described(replace(spec, layers=())),
        "the torch attention backend": model,
        "object does not describe itself for the native stack": object(),
    }
    for reason, described in cases.items():
        caplog.clear()
        with caplog.at_level("DEBUG", logger="tokenloom.engine"):
            assert NativeStack.build(described, "torch" if described is model else "native") is None
        assert f"steps run layer by layer: {reason}" in caplog.text
    assert NativeStack.build(_Described(spec), "native") is not None


def test_tensor_parallel_models_say_so(tiny_quantized, monkeypatch):
    import tokenloom.model.models.llama as llama
    monkeypatch.setattr(llama, "tp_group", lambda: type("Group", (), {"size": 2})())
    assert tiny_quantized("qwen3").native_stack_spec() == "tensor parallel"


def test_a_mixture_of_experts_model_says_why(tiny_models):
    """Qwen3-MoE's layer 0 has experts (its layer 1 a dense MLP)."""
    from tokenloom.model.loader import load_model
    model = load_model(tiny_models("qwen3_moe")[0], torch.float32, torch.device("cpu"), progress=False).model
    assert model.native_stack_spec() == "layer 0: a mixture-of-experts MLP"


def test_with_the_kernels_off_no_model_takes_it(monkeypatch, caplog):
    """TOKENLOOM_KERNELS=off (or no build for this CPU): the torch path runs every step layer by layer."""
    from tokenloom import kernels
    from tokenloom.model.native_stack import NativeStack
    monkeypatch.setattr(kernels, "enabled", lambda: False)
    with caplog.at_level("DEBUG", logger="tokenloom.engine"):
        assert NativeStack.build(_Described(None), "native") is None
    assert "steps run layer by layer: the native kernels are off" in caplog.text
