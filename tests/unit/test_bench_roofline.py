"""`tokenloom bench roofline`'s pieces: the bandwidth passes, and the bytes a decode step reads."""
from __future__ import annotations

import math

import pytest
import torch
from test_gguf_loading import build_tiny_llama

from tokenloom import kernels
from tokenloom.bench import roofline
from tokenloom.model.layers.quantized_linear import quantized_weights
from tokenloom.model.loader import load_model, panel_cache


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "1")


def test_the_bandwidth_passes_report_a_finite_positive_rate():
    for gbps in (roofline.triad_gbps(rounds=2, mib=8), roofline.read_gbps(rounds=2, mib=8)):
        assert math.isfinite(gbps) and gbps > 0


@pytest.mark.skipif(not kernels.load(), reason="kernels: the panel cache holds weights loaded for the native kernels")
def test_a_step_reads_every_loaded_weight_but_an_untied_embedding(tmp_path):
    tiny = build_tiny_llama(str(tmp_path / "tiny.gguf"))  # an untied head (output.weight)
    net = load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False, quantized=True).model
    mapped = panel_cache.MappedPanels.lookup(tiny.path, 0, 1)
    embedding = net.model.embed_tokens.weight
    multiplied = [w for w in quantized_weights(net) if w is not embedding]
    dense = sum(p.numel() * p.element_size() for p in net.parameters())
    assert roofline.weight_bytes(mapped) == sum(w.nbytes for w in multiplied) + dense


@pytest.mark.skipif(not kernels.load(), reason="kernels: the panel cache holds weights loaded for the native kernels")
def test_the_kv_cache_bytes_are_keys_and_values_of_every_layer_at_the_context(tmp_path):
    tiny = build_tiny_llama(str(tmp_path / "tiny.gguf"))
    load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False, quantized=True)
    mapped = panel_cache.MappedPanels.lookup(tiny.path, 0, 1)
    arch = mapped.arch_config
    assert roofline.kv_bytes(mapped, 100, "bfloat16") == arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 200


def test_the_report_states_the_fraction_of_the_triad_bandwidth():
    r = roofline.Roofline(threads=2, triad_gbps=20.0, read_gbps=25.0, weight_bytes=10**9, gguf_weight_bytes=5 * 10**8,
                          kv_bytes=0, context=256, step_ms=100.0, kv_dtype="float32")
    assert r.step_gbps == pytest.approx(10.0) and r.fraction == pytest.approx(0.5)
    assert "10.0 GB/s, 50% of the triad" in roofline.report(r)
    assert "2.00x" in roofline.report(r)
