"""Which attention backend an engine runs: chosen once from the config, then one instance of it is handed to
the model's constructor (its layers' impls) and to the runner (the step's metadata). No module state: two
engines in one process (the tests') may run different backends."""
from __future__ import annotations

import torch

from tokenloom import kernels
from tokenloom.config import ConfigError
from tokenloom.model.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from tokenloom.model.layers.attention_flashinfer import FlashInferBackend, supports
from tokenloom.model.layers.attention_native import NativeAttentionBackend

BACKEND_NAMES = ("flashinfer", "native", "torch")


def choose_attention_backend(name: str, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                             kv_dtype: torch.dtype | None = None, windowed: bool = False) -> str:
    """The backend's name for `--attention-backend name`. "auto": on CUDA, FlashInfer when it imports, the KV
    cache is float16/bfloat16 and no layer attends within a sliding window (not wired to FlashInfer yet), else
    torch; on CPU, the native kernels for float32 activations when they load, else torch."""
    on_cpu = device is None or device.type == "cpu"
    if name == "auto":
        if not on_cpu:
            name = "flashinfer" if supports(device, kv_dtype or dtype) and not windowed else "torch"
        else:
            name = "native" if dtype == torch.float32 and kernels.enabled() else "torch"
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown attention backend {name!r} (known: auto, {', '.join(BACKEND_NAMES)})")
    if name == "native" and not (on_cpu and dtype == torch.float32):
        raise ConfigError("--attention-backend native runs float32 activations on the CPU only; use torch")
    return name


def make_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the named backend (a name `choose_attention_backend` returned)."""
    if name == "flashinfer":
        return FlashInferBackend()
    if name == "native":
        return NativeAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    raise ConfigError(f"unknown attention backend {name!r} (known: {', '.join(BACKEND_NAMES)})")


def standalone_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend of a model loaded outside an engine (tests, tools): the native one on CPU when its kernels
    load, else torch. Its impls also run the torch backend's metadata (the native impls fall back to the torch
    reference for it), which is what such callers build by hand."""
    native = device.type == "cpu" and dtype == torch.float32 and kernels.enabled()
    return NativeAttentionBackend() if native else TorchAttentionBackend()
