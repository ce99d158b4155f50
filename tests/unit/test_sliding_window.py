"""A model whose attention window is shorter than its context is served with the context clamped to the
window (sliding-window attention itself is not implemented yet), with a warning that says so."""
from __future__ import annotations

import logging

import torch
import transformers

import helpers
from tokenloom.config import EngineConfig
from tokenloom.engine.core import EngineCore


def _mistral(folder: str, **overrides) -> str:
    config = transformers.MistralConfig(**{**helpers.TINY_COMMON, "num_key_value_heads": 2, **overrides})
    torch.manual_seed(0)
    return helpers.save_tiny_model(transformers.AutoModelForCausalLM.from_config(config), folder)


def _engine(folder: str) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(model=folder, device="cpu", dtype="float32", num_blocks=64,
                                               log_stats_interval=0), progress=False)


def test_a_sliding_window_shorter_than_the_context_clamps_max_model_len_with_a_warning(tmp_path, caplog):
    folder = _mistral(str(tmp_path), sliding_window=48)
    with caplog.at_level(logging.WARNING, logger="tokenloom.engine"):
        core = _engine(folder)
    assert core.max_model_len == 48
    assert "sliding window of 48 tokens" in caplog.text


def test_a_window_as_long_as_the_context_changes_nothing(tmp_path):
    folder = _mistral(str(tmp_path), sliding_window=4096)
    assert _engine(folder).max_model_len == helpers.TINY_COMMON["max_position_embeddings"]


def test_qwen2_configs_that_switch_the_window_off_are_not_clamped(tmp_path):
    config = transformers.Qwen2Config(**{**helpers.TINY_COMMON, "num_key_value_heads": 2, "sliding_window": 16,
                                         "use_sliding_window": False})
    folder = helpers.save_tiny_model(transformers.AutoModelForCausalLM.from_config(config), str(tmp_path))
    assert _engine(folder).max_model_len == helpers.TINY_COMMON["max_position_embeddings"]
