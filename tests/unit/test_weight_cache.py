"""The weight cache is keyed by the model file's content, bounded in size, and reports what it holds."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from test_gguf_loading import build_tiny_llama

from tokenloom.model.loader import load_model, open_model_source
from tokenloom.model.loader import weight_cache as wc
from tokenloom.model.loader.weight_cache import CachedWeights


@pytest.fixture(autouse=True)
def dense_weights(monkeypatch):
    """These tests are about entries of dense tensors per dtype: load as the torch path does. (With the native
    kernels a float32 GGUF load keeps its blocks, in an entry of its own: the round trip in
    test_gguf_loading.py covers that one.)"""
    import tokenloom.model.loader as loader
    monkeypatch.setattr(loader, "keeps_quantized", lambda *args: False)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "1")
    monkeypatch.delenv("TOKENLOOM_WEIGHT_CACHE_MAX_GB", raising=False)


@pytest.fixture
def tiny_path(tmp_path):
    (tmp_path / "install-a").mkdir()
    return build_tiny_llama(str(tmp_path / "install-a" / "tiny.gguf")).path


def _load(path: str, dtype=torch.float32):
    return load_model(path, dtype, torch.device("cpu"), progress=False)


def test_a_moved_install_reuses_the_entry(tiny_path, tmp_path):
    _load(tiny_path)
    moved = tmp_path / "install-b" / "tiny.gguf"
    moved.parent.mkdir()
    shutil.move(tiny_path, moved)
    os.utime(moved, (time.time() + 100, time.time() + 100))  # a fresh file time, as a reinstall gives
    assert isinstance(open_model_source(str(moved), torch.float32), CachedWeights)
    assert len(wc.entries()) == 1


def test_a_changed_file_is_not_served_from_the_cache(tiny_path, tmp_path):
    _load(tiny_path)
    other = build_tiny_llama(str(tmp_path / "other.gguf"), seed=1).path
    assert not isinstance(open_model_source(other, torch.float32), CachedWeights)


def test_each_dtype_is_its_own_entry(tiny_path):
    _load(tiny_path, torch.float32)
    _load(tiny_path, torch.bfloat16)
    assert sorted(e.dtype for e in wc.entries()) == ["bfloat16", "float32"]


def test_the_cache_is_trimmed_to_its_bound_least_recently_used_first(tiny_path, monkeypatch):
    _load(tiny_path, torch.float32)
    one_entry = wc.entries()[0].bytes
    time.sleep(0.05)
    _load(tiny_path, torch.bfloat16)
    time.sleep(0.05)
    assert isinstance(open_model_source(tiny_path, torch.float32), CachedWeights)  # float32 used last now
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE_MAX_GB", str(1.5 * one_entry / 2 ** 30))
    removed = wc.trim()
    assert [e.dtype for e in removed] == ["bfloat16"]
    assert [e.dtype for e in wc.entries()] == ["float32"]


def test_the_entry_just_stored_stays_even_over_the_bound(tiny_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE_MAX_GB", "0")
    _load(tiny_path)
    assert len(wc.entries()) == 1


def test_cache_command_reports_the_entries_and_clears_them(tiny_path):
    _load(tiny_path)
    cli = [sys.executable, "-m", "tokenloom.entrypoints.cli", "cache"]
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert shown.returncode == 0, shown.stderr
    assert "1 entry" in shown.stdout and "float32" in shown.stdout and tiny_path in shown.stdout
    cleared = subprocess.run(cli + ["--clear"], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert cleared.returncode == 0 and "removed 1 entry" in cleared.stdout
    assert wc.entries() == []
