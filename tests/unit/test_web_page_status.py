"""The web page's server side without a browser: the --no-ui flag, the routes it adds, and the
engine view's arithmetic (percentiles, quantization label). The page itself is tested in a
real browser in tests/e2e/test_web_page.py."""
from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from tokenloom.config import EngineConfig
from tokenloom.core.stats import EngineStats
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.api_server import add_serve_args
from tokenloom.entrypoints.openai.app import ServerSettings, build_app
from tokenloom.entrypoints.ui.status import percentiles, quantization


def parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(["smollm2-135m-instruct", *argv])


def test_the_page_is_on_by_default():
    assert parse().enable_ui is True


def test_no_ui_flag_turns_it_off():
    assert parse("--no-ui").enable_ui is False


def test_no_ui_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_NO_UI", "1")
    assert parse().enable_ui is False


@pytest.mark.parametrize("enable_ui, status", [(True, 200), (False, 404)])
def test_the_app_serves_the_page_only_when_enabled(enable_ui, status):
    # An engine object that is not started: enough to build the app and route requests.
    engine = AsyncLLM(EngineConfig(), served_model_name="m")
    app = build_app(engine, ServerSettings(served_model_names=["m"], enable_ui=enable_ui))
    with TestClient(app) as client:
        assert client.get("/").status_code == status
        assert client.get("/ui/static/js/engine.js").status_code == status


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_percentiles_of_one_value_are_that_value():
    assert percentiles([0.25]) == {"p50": 0.25, "p90": 0.25, "p99": 0.25}


def test_percentiles_of_an_empty_window_are_none():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("name, kept, label", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", True, "GGUF Q4_1, quantized on the native kernels"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", False, "GGUF Q4_1, dequantized to float32 at load"),
    ("model-f16.gguf", False, "GGUF F16, dequantized to float32 at load"),
    ("model.gguf", True, "GGUF, quantized on the native kernels"),
    ("model.safetensors", False, "none"),
])
def test_quantization_label_says_how_the_engine_holds_the_weights(name, kept, label):
    assert quantization(name, kept, "float32") == label


def test_the_engine_reports_gguf_blocks_kept_quantized_and_their_memory(make_llm, embedded_loaded):
    """The page's weights chip comes from what the engine reports: on the CPU with the native kernels the
    embedded Q4_1 model stays in its blocks, and its memory is the quantized size (about 94 MiB; float32
    would be four bytes a parameter, ~540 MiB)."""
    from tokenloom import kernels
    info = make_llm(num_blocks=16).engine.info
    assert info.weights_quantized == kernels.load()
    assert info.weights_bytes == embedded_loaded.bytes
    if info.weights_quantized:
        assert info.weights_bytes < embedded_loaded.num_params * 4 / 3


def test_token_rates_are_the_counters_rise_over_the_elapsed_time():
    import time

    from tokenloom.entrypoints.ui.status import StatusTracker

    engine = AsyncLLM(EngineConfig.from_kwargs(max_model_len=512), served_model_name="m")
    tracker = StatusTracker(engine)
    try:
        engine.client.last_stats = EngineStats(generation_tokens=100, prompt_tokens=0, steps=10, batched_tokens=10)
        first = tracker.snapshot()
        time.sleep(1.0)
        engine.client.last_stats = EngineStats(generation_tokens=150, prompt_tokens=0, steps=60, batched_tokens=60)
        second = tracker.snapshot()
        elapsed = second["time"] - first["time"]
        assert second["generation_tps"] == pytest.approx(50 / elapsed)
        assert second["budget_use"] == pytest.approx(1 / engine.config.scheduler.max_num_batched_tokens)
    finally:
        tracker.close()
