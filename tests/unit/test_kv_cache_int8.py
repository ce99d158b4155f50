"""The 8-bit KV cache (`--kv-cache-dtype int8`, alias fp8): the row format, the native write, decode and
prefill kernels against their torch references on the same bytes, and an engine on it: its capacity, the
paths that move blocks (prefix cache, offload tier, P/D pull) carrying the scales, and a draft model's
cache. Native against torch backend on it: test_kernels_layers.py; accuracy on the embedded model:
tests/e2e/test_kv_cache_int8_embedded.py."""
from __future__ import annotations

import pytest
import torch
from helpers import generate_tokens, greedy_params, make_request, random_prompts

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.kernels.attention_ops import paged_attention_decode_reference, write_kv_cache_reference
from tokenloom.kernels.kv_int8 import dequantize_rows, quantize_rows
from tokenloom.kernels.prefill_attention_ops import paged_attention_prefill_reference
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.puller import pull
from tokenloom.kv_transfer.transport import KVServer, PullRequest

CACHE_BLOCK = 16
# Offload: a cache of 96 tokens that the three fillers' prompts evict the first prompt's blocks from.
BLOCK, NUM_BLOCKS = 4, 24
PROMPT, *FILLERS = random_prompts(4, [30, 60, 60, 60], 512, seed=11)


def run(core, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """One request alone: its greedy tokens and how many prompt tokens came from the cache."""
    core.add_request(make_request(rid, prompt, greedy_params(6)))
    outs = []
    while core.has_unfinished_requests():
        outs.extend(o for o in core.step() if o.request_id == rid)
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


def _int8_cache(num_blocks: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    """Random keys and values, quantized as the engine stores them."""
    g = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(2, num_blocks, CACHE_BLOCK, kv_heads, dim, generator=g))


def _tables(lens: list[int], num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = max((n + CACHE_BLOCK - 1) // CACHE_BLOCK for n in lens)
    return torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()


def test_a_row_reads_back_within_half_a_step_of_its_own_scale():
    x = torch.randn(50, 4, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 4, 68)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_rows(rows) - x).abs() <= scale / 2 + 1e-7 * x.abs()).all()


def test_an_all_zero_row_stores_zeros_and_a_zero_scale():
    rows = quantize_rows(torch.zeros(3, 8))
    assert not rows.any()
    assert not dequantize_rows(rows).any()


@pytest.mark.kernels
def test_the_native_cache_write_stores_the_same_bytes_as_the_reference():
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(37, 3, 64, generator=g) * 5, torch.randn(37, 3, 64, generator=g)
    slots = torch.randperm(8 * CACHE_BLOCK, generator=g)[:37]
    native = torch.zeros(2, 8, CACHE_BLOCK, 3, 68, dtype=torch.int8)
    reference = native.clone()
    torch.ops.tokenloom.write_kv_cache(key, value, native, slots)
    write_kv_cache_reference(key, value, reference, slots)
    assert torch.equal(native, reference)


@pytest.mark.kernels
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, 0), (8, 2, 128, 0), (6, 1, 40, 0), (9, 3, 64, 100)])
def test_decode_over_an_int8_cache_matches_the_reference_on_the_same_bytes(heads, kv_heads, dim, window):
    lens = [1, 17, 130, 300]
    cache = _int8_cache(4 * 19 + 2, kv_heads, dim, seed=2)
    tables = _tables(lens, cache.shape[1], seed=3)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(4))
    context = torch.tensor(lens, dtype=torch.int32)
    got = torch.ops.tokenloom.paged_attention_decode(q, cache, tables, context, dim ** -0.5, window)
    want = paged_attention_decode_reference(q, cache, tables, context, dim ** -0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, 0), (6, 1, 40, 0), (9, 3, 64, 50)])
def test_prefill_over_an_int8_cache_matches_the_reference_on_the_same_bytes(heads, kv_heads, dim, window):
    lens, chunks = [70, 200], [70, 33]  # a fresh prompt, and a chunk continuing a cached one
    cache = _int8_cache(30, kv_heads, dim, seed=5)
    tables = _tables(lens, cache.shape[1], seed=6)
    starts = torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32)
    q = torch.randn(sum(chunks), heads, dim, generator=torch.Generator().manual_seed(7))
    context = torch.tensor(lens, dtype=torch.int32)
    got, want = torch.zeros(sum(chunks), heads * dim), torch.zeros(sum(chunks), heads * dim)
    torch.ops.tokenloom.paged_attention_prefill(q, cache, tables, starts, context, dim ** -0.5, window, got)
    paged_attention_prefill_reference(q, cache, tables, starts, context, dim ** -0.5, window, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e4m3", "FP8"])
def test_vllms_fp8_names_select_the_8bit_cache(name):
    assert EngineConfig.from_kwargs(kv_cache_dtype=name).cache.kv_cache_dtype == "int8"


def test_fp8_e5m2_is_refused_with_a_config_error():
    with pytest.raises(ConfigError, match="fp8_e5m2"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8_e5m2")


def test_the_engine_holds_2_head_dim_over_head_dim_plus_4_times_the_bfloat16_blocks_in_the_same_memory(make_core):
    half = make_core(kv_cache_memory=0.01, kv_cache_dtype="bfloat16")
    eight = make_core(kv_cache_memory=0.01, kv_cache_dtype="fp8")
    cache = eight.executor.worker.runner.kv_caches[0]
    head_dim = half.executor.worker.runner.kv_caches[0].shape[-1]
    assert cache.dtype == torch.int8 and cache.shape[-1] == head_dim + 4
    # A row of head_dim int8 values and a 4-byte scale against head_dim bfloat16 values (each count floored).
    assert eight.info.num_blocks == pytest.approx(half.info.num_blocks * 2 * head_dim / (head_dim + 4), abs=1)
    assert "KV cache (int8)" in eight.info.summary


def test_a_prefix_cache_hit_and_an_offloaded_prefix_give_the_uncached_int8_output(make_core):
    reference = run(make_core("llama", block_size=BLOCK, num_blocks=NUM_BLOCKS, kv_cache_dtype="int8",
                              enable_prefix_caching=False), "ref", PROMPT)[0]
    core = make_core("llama", block_size=BLOCK, num_blocks=NUM_BLOCKS, kv_cache_dtype="int8",
                     kv_offloading_backend="native")
    assert run(core, "a", PROMPT)[0] == reference
    got, cached = run(core, "hit", PROMPT)
    assert cached > 0 and got == reference
    for i, filler in enumerate(FILLERS):
        run(core, f"filler{i}", filler)
    got, cached = run(core, "loaded", PROMPT)
    assert core.stats()["kv_offload_loaded"] > 0
    assert cached > 0 and got == reference


def test_a_pd_pull_copies_int8_blocks_with_their_scales():
    source = [_int8_cache(12, 2, 8, seed=s)[:, :, :4].contiguous() for s in range(3)]
    server = KVServer(source, "me", "127.0.0.1", 0, "tcp")
    try:
        server.publish("t", [1, 2, 7], lease_s=10)
        mine = [torch.zeros_like(c) for c in source]
        request = PullRequest(transfer_id="t", identity="me", layout=layout(mine), first_block=0, num_blocks=3)
        assert pull(server.address, request, mine, [5, 0, 9], timeout_s=5) is None
    finally:
        server.close()
    for got, sent in zip(mine, source):
        assert torch.equal(dequantize_rows(got[:, [5, 0, 9]]), dequantize_rows(sent[:, [1, 2, 7]]))


def test_a_draft_model_with_its_own_int8_cache_keeps_the_greedy_output(make_core, tiny_models):
    draft = {"method": "draft_model", "model": tiny_models("llama")[0], "num_speculative_tokens": 4}
    prompts = random_prompts(3, [5, 20, 33], vocab=512, seed=3)
    off = make_core(kv_cache_dtype="int8")
    on = make_core(kv_cache_dtype="int8", speculative_config=draft)
    assert on.executor.worker.runner.drafter.kv_caches[0].dtype == torch.int8
    params = greedy_params(16)
    assert generate_tokens(on, prompts, params) == generate_tokens(off, prompts, params)
    assert on.stats()["spec_num_accepted_tokens"] > 0
