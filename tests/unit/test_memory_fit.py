"""A model larger than the machine's memory is refused at once, with one line naming both sizes."""
from __future__ import annotations

import pytest
import torch

from tokenloom.model.loader import load_model, memory_fit, read_arch_config


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "big.gguf"
    path.write_bytes(b"\0" * (3 << 20))  # 3 MiB: the check runs before the file is read
    return str(path)


def test_a_model_larger_than_memory_fails_before_loading_with_both_sizes(model_file, monkeypatch):
    monkeypatch.setattr(memory_fit, "machine_memory", lambda: 2 << 20)
    with pytest.raises(memory_fit.ModelTooLargeError) as caught:
        load_model(model_file, torch.float32, torch.device("cpu"), progress=False)
    assert str(caught.value) == f"{model_file}: its weights take 3 MiB, more than this machine's 2 MiB of memory"


def test_the_engine_refuses_it_when_it_first_reads_the_architecture(model_file, monkeypatch):
    monkeypatch.setattr(memory_fit, "machine_memory", lambda: 2 << 20)
    with pytest.raises(memory_fit.ModelTooLargeError):
        read_arch_config(model_file)


def test_a_model_that_fits_goes_on_to_be_read(model_file, monkeypatch):
    monkeypatch.setattr(memory_fit, "machine_memory", lambda: 4 << 20)
    with pytest.raises(ValueError) as caught:  # past the check: the loader finds no GGUF in the zeros
        read_arch_config(model_file)
    assert not isinstance(caught.value, memory_fit.ModelTooLargeError)


def test_the_machine_memory_is_read_and_plausible():
    memory = memory_fit.machine_memory()
    assert memory is not None and memory > 256 << 20
