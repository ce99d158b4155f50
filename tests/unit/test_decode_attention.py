"""Decode attention over the paged cache: sequences in groups, and a reduced-precision KV cache."""
from __future__ import annotations

import helpers
import torch

from tokenloom.model.layers.attention import DECODE_GROUP, AttentionMetadata, TorchAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4


def _decode_inputs(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (batch,), generator=g)
    width = int((lens.max() + BLOCK - 1) // BLOCK)
    num_blocks = batch * width + 1
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    tables = torch.randperm(num_blocks - 1, generator=g)[: batch * width].view(batch, width) + 1
    mask = (torch.arange(width * BLOCK).unsqueeze(0) < lens.unsqueeze(1)).view(batch, 1, 1, -1)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    return q, cache, tables, lens, mask


def _reference(q, cache, tables, lens):
    """Each sequence alone, its keys and values read block by block."""
    rows = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        keys = cache[0][tables[i]].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(HEADS // KV_HEADS, 1)
        values = cache[1][tables[i]].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,thd->ht", q[i], keys) * HEAD_DIM ** -0.5
        rows.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(rows)


def _decode(q, cache, tables, lens, mask, group_blocks=None):
    attn = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), q.shape[0], tables, lens, mask, [],
                             decode_group_blocks=group_blocks)
    return attn._decode(q, cache[0], cache[1], meta)


def test_decode_batch_spanning_several_groups_matches_each_sequence_alone():
    batch = 2 * DECODE_GROUP + 5  # two full groups and a partial one
    q, cache, tables, lens, mask = _decode_inputs(batch)
    torch.testing.assert_close(_decode(q, cache, tables, lens, mask), _reference(q, cache, tables, lens),
                               rtol=1e-5, atol=1e-5)


def test_groups_sorted_by_length_attend_over_only_their_own_blocks():
    batch = 2 * DECODE_GROUP + 5
    q, cache, tables, lens, mask = _decode_inputs(batch, seed=2)
    order = lens.argsort()
    q, tables, lens, mask = q[order], tables[order], lens[order], mask[order]
    blocks = [int(lens[i:i + DECODE_GROUP].max() + BLOCK - 1) // BLOCK for i in range(0, batch, DECODE_GROUP)]
    assert blocks[0] < tables.shape[1]  # the short group really reads fewer blocks
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(_decode(q, cache, tables, lens, additive, blocks),
                               _reference(q, cache, tables, lens), rtol=1e-5, atol=1e-5)


def test_bfloat16_kv_cache_decode_stays_close_to_float32():
    q, cache, tables, lens, mask = _decode_inputs(DECODE_GROUP + 3, seed=1)
    got = _decode(q, cache.bfloat16(), tables, lens, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(q, cache, tables, lens), rtol=0, atol=3e-2)


def test_block_diagonal_decode_computes_exact_attention():
    """The reduced-precision CPU path, run in float32 so any error is the algorithm's, not rounding's."""
    q, cache, tables, lens, mask = _decode_inputs(5, seed=3)
    n, width = tables.shape
    keys = cache[0][tables].reshape(n, -1, KV_HEADS * HEAD_DIM)
    values = cache[1][tables].reshape(n, -1, KV_HEADS * HEAD_DIM)
    additive = torch.zeros(n, 1, width * BLOCK).masked_fill(~mask.view(n, 1, -1), float("-inf"))
    attention = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
    scaled_q = q.view(n, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM) * attention.scale
    got = attention._block_diagonal(scaled_q, keys, values, additive).reshape(n, -1)
    torch.testing.assert_close(got, _reference(q, cache, tables, lens), rtol=1e-5, atol=1e-5)


def test_bfloat16_kv_cache_with_an_additive_mask_takes_the_block_diagonal_path_and_stays_close():
    q, cache, tables, lens, mask = _decode_inputs(DECODE_GROUP + 3, seed=4)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    got = _decode(q, cache.bfloat16(), tables, lens, additive)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(q, cache, tables, lens), rtol=0, atol=3e-2)


def test_engine_allocates_a_bfloat16_kv_cache_holding_twice_the_blocks(make_core):
    full = make_core(kv_cache_memory=0.01)
    half = make_core(kv_cache_memory=0.01, kv_cache_dtype="bfloat16")
    assert half.executor.worker.runner.kv_caches[0].dtype == torch.bfloat16
    assert half.info.num_blocks == 2 * full.info.num_blocks
    assert "KV cache (bfloat16)" in half.info.summary


def test_more_concurrent_decodes_than_one_group_give_each_prompt_its_greedy_output_alone(make_core):
    core = make_core(max_num_seqs=64)
    prompts = helpers.random_prompts(2 * DECODE_GROUP + 7, [1, 5, 9, 17, 30], vocab=512)
    outputs = helpers.generate_tokens(core, prompts, helpers.greedy_params(12))
    model = core.executor.worker.setup.loaded.model
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 12
        assert helpers.greedy_mismatch(model, prompt, out) is None


def test_bfloat16_decode_takes_sdpa_for_small_groups_and_block_diagonal_gemms_for_large_ones(monkeypatch):
    import tokenloom.model.layers.attention as attention
    q, cache, tables, lens, mask = _decode_inputs(DECODE_GROUP + 3, seed=4)
    cache = cache.bfloat16()
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    calls = []  # group sizes that took the block-diagonal GEMMs
    original = TorchAttention._block_diagonal

    def counted(self, group_q, *rest):
        calls.append(group_q.shape[0])
        return original(self, group_q, *rest)

    monkeypatch.setattr(TorchAttention, "_block_diagonal", counted)
    results = {}
    for threshold in (10 ** 9, 0):
        monkeypatch.setattr(attention, "BLOCK_DIAGONAL_MIN_TOKENS", threshold)
        calls.clear()
        results[threshold] = _decode(q, cache, tables, lens, additive)
        assert calls == ([] if threshold else [DECODE_GROUP, 3])
    reference = _reference(q, cache.float(), tables, lens)
    for got in results.values():
        torch.testing.assert_close(got, reference, rtol=0, atol=3e-2)
    torch.testing.assert_close(results[0], results[10 ** 9], rtol=0, atol=2e-2)
