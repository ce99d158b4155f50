"""The quantized weights' move into transparent huge pages (tokenloom/model/huge_pages.py): where they
land, that their products do not change, and the switch that keeps them where they were."""
from __future__ import annotations

import pytest
import torch
from skip_policy import require_kernels
from test_kernels_quant import _random_weight

from tokenloom.model.huge_pages import move_panels_to_huge_pages

COLUMNS, K = 4096, 576  # ~1.5 MiB of panels a weight: two of them pass the 2 MiB a huge page holds


def _weights(n=2):
    return [_random_weight(COLUMNS, K, 4, 32, seed=i).interleaved() for i in range(n)]


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping that holds `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head.endswith(":") and len(line.split()) >= 2 and line.split()[1].isdigit():
                fields[head[:-1]] = int(line.split()[1])
    return fields


def test_every_panel_tensor_moves_into_one_region():
    weights = _weights()
    moved = move_panels_to_huge_pages(weights)
    tensors = [t for w in weights for t in (w.panels.qpacked, w.panels.scales, w.panels.mins)]
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    starts = sorted(t.data_ptr() for t in tensors)
    assert starts[-1] - starts[0] < moved
    assert all(t.data_ptr() % 64 == 0 for t in tensors)


@pytest.mark.skipif(not _thp_available(), reason="huge pages: transparent huge pages are off on this machine")
def test_the_region_is_backed_by_huge_pages():
    weights = _weights()
    move_panels_to_huge_pages(weights)
    assert _mapping_of(weights[0].panels.qpacked.data_ptr()).get("AnonHugePages", 0) >= 2048


@pytest.mark.parametrize("int8", [False, True])
def test_moved_weights_multiply_bit_for_bit_as_before(int8):
    require_kernels()
    weights = _weights()
    for w in weights:
        w.activations_int8 = int8
    x = torch.randn(3, K)
    before = [w.linear(x) for w in weights]
    move_panels_to_huge_pages(weights)
    assert all(torch.equal(w.linear(x), b) for w, b in zip(weights, before))


def test_a_weight_listed_twice_moves_once():
    weights = _weights()
    moved = move_panels_to_huge_pages(weights + weights[:1])
    assert moved == move_panels_to_huge_pages(_weights())


def test_huge_pages_off_leaves_the_weights_where_they_are(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_HUGE_PAGES", "off")
    weights = _weights()
    before = [w.panels.qpacked.data_ptr() for w in weights]
    assert move_panels_to_huge_pages(weights) == 0
    assert [w.panels.qpacked.data_ptr() for w in weights] == before


def test_less_than_a_huge_page_of_weights_is_not_moved():
    small = [_random_weight(64, K, 4, 32).interleaved()]
    assert move_panels_to_huge_pages(small) == 0
