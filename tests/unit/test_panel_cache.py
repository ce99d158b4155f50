"""The panel cache: a quantized model's loaded form written on the first load and memory-mapped by the next,
with every weight bit for bit what the GGUF gives (tokenloom/model/loader/panel_cache.py)."""
from __future__ import annotations

import os

import pytest
import torch
from test_gguf_loading import build_tiny_llama, loaded_parameter

from tokenloom import kernels
from tokenloom.model.layers.quantized_linear import quantized_weights
from tokenloom.model.loader import load_model, panel_cache
from tokenloom.model.loader import weight_cache as wc

pytestmark = pytest.mark.skipif(not kernels.load(),
                                reason="kernels: quantized weights load for the native kernels only")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "1")
    monkeypatch.delenv("TOKENLOOM_WEIGHT_CACHE_MAX_GB", raising=False)


@pytest.fixture
def tiny(tmp_path):
    return build_tiny_llama(str(tmp_path / "tiny.gguf"))


def _load(path: str):
    return load_model(path, torch.float32, torch.device("cpu"), progress=False, quantized=True)


def _mapping_of(address: int) -> str:
    """The file (or "" for anonymous memory) mapped at `address` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) > 5 else ""
    raise LookupError(hex(address))


def test_the_first_load_writes_the_panels_and_the_second_reads_the_same_weights(tiny):
    assert panel_cache.MappedPanels.lookup(tiny.path, 0, 1) is None
    first = _load(tiny.path)
    assert panel_cache.MappedPanels.lookup(tiny.path, 0, 1) is not None
    second = _load(tiny.path)
    assert second.arch == first.arch and second.bytes == first.bytes
    for a, b in zip(quantized_weights(first.model), quantized_weights(second.model), strict=True):
        assert (a.bits, a.block_size, a.panels.columns) == (b.bits, b.block_size, b.panels.columns)
        for part in ("qpacked", "scales", "mins"):
            assert torch.equal(getattr(a.panels, part), getattr(b.panels, part))
    for name, want in tiny.expected.items():
        assert torch.equal(loaded_parameter(second.model, name), want), name


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="platform: reads Linux's /proc/self/maps")
def test_without_huge_pages_the_weights_are_read_in_place_from_the_mapped_file(tiny, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_HUGE_PAGES", "off")
    _load(tiny.path)
    entry = str(panel_cache.entry_path(tiny.path, 0, 1))
    weights = quantized_weights(_load(tiny.path).model)
    assert weights
    for w in weights:
        for part in (w.panels.qpacked, w.panels.scales, w.panels.mins):
            assert _mapping_of(part.data_ptr()) == entry


def test_an_entry_is_per_tensor_parallel_rank_and_layout(tiny):
    paths = {panel_cache.entry_path(tiny.path, rank, world) for rank, world in ((0, 1), (0, 2), (1, 2))}
    assert len(paths) == 3


def test_a_damaged_entry_is_ignored_and_the_gguf_loads(tiny):
    _load(tiny.path)
    entry = panel_cache.entry_path(tiny.path, 0, 1)
    entry.write_bytes(b"not a panel file")
    assert panel_cache.MappedPanels.lookup(tiny.path, 0, 1) is None
    again = _load(tiny.path)
    for name, want in tiny.expected.items():
        assert torch.equal(loaded_parameter(again.model, name), want), name


def test_the_cache_listing_counts_the_entry_and_trimming_removes_it(tiny):
    _load(tiny.path)
    listed = wc.entries()
    assert [e.stem.with_suffix(wc.PANELS) for e in listed] == [panel_cache.entry_path(tiny.path, 0, 1)]
    assert listed[0].dtype.startswith("quantized panels") and listed[0].source.endswith("tiny.gguf")
    wc.trim(limit=0)
    assert wc.entries() == [] and panel_cache.MappedPanels.lookup(tiny.path, 0, 1) is None


def test_a_warm_start_makes_its_entry_the_most_recently_used(tiny, tmp_path):
    _load(tiny.path)
    other = build_tiny_llama(str(tmp_path / "other.gguf"), seed=1).path
    _load(other)
    assert wc.entries()[0].source.endswith("other.gguf")
    _load(tiny.path)
    assert wc.entries()[0].source.endswith("tiny.gguf")
