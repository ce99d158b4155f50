"""The KV offload tier on a real EngineCore over a tiny random Llama with a KV cache small enough that a
prompt's prefix-cache blocks are evicted by the next requests: evicted blocks are saved, a later hit loads
them back with output unchanged, the disk tier survives a restart, its size stays bounded, and another
model or another cache salt never reads them."""
from __future__ import annotations

import logging
import os
import random

import pytest
from helpers import greedy_params, make_request, random_prompts

BLOCK = 4
NUM_BLOCKS = 24  # 96 tokens: the fillers below evict everything a first request left in the prefix cache
PROMPT, *FILLERS = random_prompts(4, [30, 60, 60, 60], 512, seed=11)
MAX_TOKENS = 6


def run(core, rid: str, prompt: list[int], salt: str | None = None):
    core.add_request(make_request(rid, prompt, greedy_params(MAX_TOKENS), cache_salt=salt))
    outs = []
    while core.has_unfinished_requests():
        outs.extend(o for o in core.step() if o.request_id == rid)
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


def evict_everything(core) -> None:
    for i, filler in enumerate(FILLERS):
        run(core, f"filler{i}", filler)


def tier_files(path) -> list[str]:
    return [f for _, _, files in os.walk(path) for f in files if f.endswith(".kv")]


@pytest.fixture(scope="module")
def reference(make_core):
    core = make_core("llama", block_size=BLOCK, num_blocks=NUM_BLOCKS, enable_prefix_caching=False)
    return run(core, "ref", PROMPT)[0]


def offload_core(make_core, kind="llama", **kw):
    return make_core(kind, block_size=BLOCK, num_blocks=NUM_BLOCKS, kv_offloading_backend="native", **kw)


def test_without_the_tier_the_fillers_evict_the_prompts_prefix(make_core):
    core = make_core("llama", block_size=BLOCK, num_blocks=NUM_BLOCKS)
    run(core, "a", PROMPT)
    evict_everything(core)
    assert run(core, "b", PROMPT)[1] == 0


def test_evicted_blocks_come_back_from_host_memory_with_identical_output(make_core, reference):
    core = offload_core(make_core)
    assert run(core, "a", PROMPT)[0] == reference
    evict_everything(core)
    assert core.stats()["kv_offload_saved"] > 0
    got, cached = run(core, "b", PROMPT)
    assert got == reference
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK  # every full block of the prompt
    assert core.stats()["kv_offload_loaded"] == cached // BLOCK


def test_the_disk_tier_keeps_its_hits_across_a_restart(make_core, reference, tmp_path):
    first = offload_core(make_core, kv_offloading_path=str(tmp_path))
    run(first, "a", PROMPT)
    evict_everything(first)
    first.shutdown()
    second = offload_core(make_core, kv_offloading_path=str(tmp_path))
    got, cached = run(second, "b", PROMPT)
    assert got == reference
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK


def test_a_clean_shutdown_saves_the_cached_blocks_so_a_restart_hits_a_prefix_never_evicted(make_core, reference,
                                                                                         tmp_path):
    first = offload_core(make_core, kv_offloading_path=str(tmp_path))
    run(first, "a", PROMPT)
    assert tier_files(tmp_path) == []  # nothing was evicted
    first.shutdown()
    assert tier_files(tmp_path)
    second = offload_core(make_core, kv_offloading_path=str(tmp_path))
    got, cached = run(second, "b", PROMPT)
    assert got == reference
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK


def test_the_shutdown_save_stays_within_the_tiers_size_keeping_the_most_recent_blocks(make_core, tmp_path):
    probe = offload_core(make_core)
    block_bytes = probe.info.kv_connector.block_bytes
    core = offload_core(make_core, kv_offloading_path=str(tmp_path), kv_offloading_size=3 * block_bytes / 2 ** 30)
    run(core, "a", FILLERS[0])
    run(core, "b", PROMPT)  # the most recent: its first blocks are the ones kept
    core.shutdown()
    assert len(tier_files(tmp_path)) == 3
    again = offload_core(make_core, kv_offloading_path=str(tmp_path), kv_offloading_size=3 * block_bytes / 2 ** 30)
    assert run(again, "c", PROMPT)[1] == 3 * BLOCK  # the prompt's first three blocks


def test_another_model_never_reads_the_blocks(make_core, tmp_path):
    first = offload_core(make_core, kv_offloading_path=str(tmp_path))
    run(first, "a", PROMPT)
    evict_everything(first)
    first.shutdown()
    other = offload_core(make_core, "qwen2", kv_offloading_path=str(tmp_path))
    assert other.stats()["kv_offload_blocks"] == 0
    assert run(other, "b", PROMPT)[1] == 0


def test_another_cache_salt_never_reads_the_blocks(make_core, reference):
    core = offload_core(make_core)
    run(core, "a", PROMPT, salt="alice")
    evict_everything(core)
    assert run(core, "b", PROMPT, salt="bob")[1] == 0
    assert run(core, "c", PROMPT, salt="alice") == (reference, (len(PROMPT) - 1) // BLOCK * BLOCK)


def test_the_disk_tier_stays_within_its_size(make_core, tmp_path):
    probe = offload_core(make_core)
    block_bytes = probe.info.kv_connector.block_bytes
    core = offload_core(make_core, kv_offloading_path=str(tmp_path), kv_offloading_size=5 * block_bytes / 2 ** 30)
    run(core, "a", PROMPT)
    evict_everything(core)
    assert core.stats()["kv_offload_saved"] > 5
    assert len(tier_files(tmp_path)) == 5


def _truncate(data: bytes) -> bytes:
    return data[:100]


def _flip_a_payload_byte(data: bytes) -> bytes:
    return data[:-7] + bytes([data[-7] ^ 0x40]) + data[-6:]  # the same length: only the checksum can tell


def _junk(data: bytes) -> bytes:
    return bytes(random.Random(len(data)).getrandbits(8) for _ in range(len(data)))


DAMAGES = [(_truncate, "truncated"), (_flip_a_payload_byte, "checksum mismatch"), (_junk, "unreadable header")]


def test_damaged_block_files_are_detected_logged_and_recomputed_never_read(make_core, reference, tmp_path, caplog):
    """The block files saved at shutdown are each damaged one of three ways, in turn: each is caught by its own
    check."""
    first = offload_core(make_core, kv_offloading_path=str(tmp_path))
    run(first, "a", PROMPT)
    first.shutdown()
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(tmp_path) for f in names)
    # 8 files (the prompt's 7 full blocks and one of its output), so each damage lands on one the prompt reads
    assert len(files) >= 2 * len(DAMAGES)
    for i, path in enumerate(files):
        with open(path, "rb") as fh:
            data = fh.read()
        with open(path, "wb") as fh:
            fh.write(DAMAGES[i % len(DAMAGES)][0](data))
    second = offload_core(make_core, kv_offloading_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tokenloom.kv_transfer"):
        got, cached = run(second, "b", PROMPT)
    assert got == reference
    assert cached == 0  # nothing it reused: every block of the prompt was damaged
    assert second.stats()["kv_offload_loaded"] > 0  # the loads were tried, and failed
    for _, why in DAMAGES:
        assert why in caplog.text
    read = [p for p in files if p in caplog.text]
    assert read and not any(os.path.exists(p) for p in read)  # removed once found damaged


def test_files_that_are_not_blocks_are_not_listed_in_the_tier(make_core, tmp_path):
    first = offload_core(make_core, kv_offloading_path=str(tmp_path))
    run(first, "a", PROMPT)
    first.shutdown()
    folder = next(root for root, _, names in os.walk(tmp_path) if names)
    saved = first.stats()["kv_offload_blocks"]
    for name in ("notes.kv", "0123.kv", "Z" * 40 + ".kv"):
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(b"junk")
    second = offload_core(make_core, kv_offloading_path=str(tmp_path))
    assert second.stats()["kv_offload_blocks"] == saved
