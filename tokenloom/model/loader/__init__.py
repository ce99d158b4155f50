"""Load a model from a GGUF file or a HF-style folder straight into the runtime dtype and device."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tokenloom import kernels
from tokenloom.distributed.expert_parallel import expert_parallel_settings
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.huge_pages import enabled as huge_pages_enabled
from tokenloom.model.huge_pages import move_panels_to_huge_pages
from tokenloom.model.layers import quantized_linear
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.layers.attention_select import standalone_attention_backend
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.loader import panel_cache, weight_cache
from tokenloom.model.loader.memory_fit import check_fits
from tokenloom.model.loader.safetensors_loader import HFModelFolder
from tokenloom.model.loader.tensor_source import TensorSource
from tokenloom.model.model_errors import CorruptModelError, ModelFileError, naming_the_file, one_line
from tokenloom.model.model_path import resolve_model_path
from tokenloom.model.models.registry import model_class

if TYPE_CHECKING:
    from tokenloom.model.loader.gguf_vlm_source import GGUFVisionLanguageSource


@dataclass
class LoadedModel:
    model: torch.nn.Module
    arch: ArchConfig
    path: str
    num_params: int
    bytes: int
    seconds: float


def _gguf_loader():
    """tokenloom.model.loader.gguf_loader, on first use: it imports the native kernels, which load (or build) at
    import, and an HF folder or a cached entry needs none of it."""
    from tokenloom.model.loader import gguf_loader  # lazy: imports the native kernels, which load at import
    return gguf_loader


def open_model_source(path: str, dtype: torch.dtype, quantized: bool = False, mmproj: str | None = None):
    """The weights' source: an HF folder, a weight-cache entry (dense in `dtype`, or the repacked blocks when
    `quantized`), the GGUF file itself, or a GGUF with its llama.cpp mmproj file (dense, never cached)."""
    if os.path.isdir(path):
        return HFModelFolder(path)
    if mmproj is not None:
        return _gguf_vlm_source().GGUFVisionLanguageSource(path, mmproj)
    cached = weight_cache.CachedWeights.lookup(path, weight_cache.QUANTIZED if quantized else dtype)
    return cached or _gguf_loader().GGUFModelFile(path)


def _gguf_vlm_source():
    """tokenloom.model.loader.gguf_vlm_source, on first use (it imports gguf_loader: see _gguf_loader)."""
    from tokenloom.model.loader import gguf_vlm_source  # lazy: imports the native kernels, which load at import
    return gguf_vlm_source


def read_arch_config(model: str | None, mmproj: str | None = None) -> ArchConfig:
    """The model's architecture without loading its weights (the EngineCore checks a parallel layout with it;
    a model larger than memory is refused here, before any process loads it). With `mmproj`, the
    vision-language model the GGUF and its mmproj file make together."""
    path = resolve_model_path(model)
    check_fits(path)
    with naming_the_file(path):
        return open_model_source(path, torch.float32, mmproj=mmproj).arch_config


def keeps_quantized(path: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF's quantized weights load as they are (the native kernels run on this CPU, float32
    activations) rather than dequantized to dense float (the torch path, TOKENLOOM_KERNELS=off)."""
    if device.type != "cpu" or dtype != torch.float32 or os.path.isdir(path):
        return False
    return kernels.load()


def load_model(model: str | None, dtype: torch.dtype, device: torch.device, progress: bool = True,
               quantized: bool | None = None, attention: AttentionBackend | None = None,
               tensors: TensorSource | None = None, mmproj: str | None = None) -> LoadedModel:
    """`quantized`: keep GGUF blocks quantized (None: when the native kernels run, keeps_quantized). `attention`:
    the backend whose impls the layers get (the engine's; None: `standalone_attention_backend`). `tensors`:
    weights already in memory (a weight update), loaded dense instead of the file's; `model` then names them.
    `mmproj`: a llama.cpp mmproj file whose vision tower (dense) joins the GGUF's text model (kept quantized as
    alone, but never cached: the caches hold the text model's loaded form)."""
    start = time.perf_counter()
    path = resolve_model_path(model) if tensors is None else str(model)
    if tensors is None:
        check_fits(path)
    if quantized is None:
        quantized = tensors is None and keeps_quantized(path, device, dtype)
    if tensors is None and mmproj is not None:
        tensors = open_model_source(path, dtype, mmproj=mmproj)
    with naming_the_file(path):
        return _load(path, dtype, device, progress, quantized, attention, tensors, start)


def _load(path: str, dtype: torch.dtype, device: torch.device, progress: bool, quantized: bool,
          attention: AttentionBackend | None, tensors: TensorSource | GGUFVisionLanguageSource | None,
          start: float) -> LoadedModel:
    """load_model's work: build the model, fill it, pack it. `tensors`: a source other than the file at `path`
    (weights in memory, or the GGUF with its mmproj), whose loaded form no cache holds."""
    tp = tp_group()
    mapped = panel_cache.MappedPanels.lookup(path, tp.rank, tp.size) if quantized and tensors is None else None
    if mapped is not None:  # the loaded form of an earlier start, memory-mapped: nothing to read or repack
        net = _empty_model(mapped.arch_config, dtype, device, attention)
        if mapped.fill(net):
            if huge_pages_enabled() and mapped.on_huge_pages():  # already on huge pages: nothing to move
                return _loaded(net, mapped.arch_config, path, start, move_to_huge_pages=False)
            return _loaded(net, mapped.arch_config, path, start, quantized, release=mapped.release)
    cache_key = weight_cache.QUANTIZED if quantized else dtype
    # A quantized model's cache entry holds the repacked blocks.
    source = tensors if tensors is not None else open_model_source(path, dtype, quantized)
    arch = source.arch_config
    net = _empty_model(arch, dtype, device, attention)
    expected = net.checkpoint_names()  # named by the parameters, before slots stand in for the weights
    if quantized:
        quantized_linear.install_slots(net)
    gguf_loader = _gguf_loader()
    from_gguf = isinstance(source, gguf_loader.GGUFModelFile)
    # A quantized model keeps its loaded form in the panel cache (one file per rank); the weight cache's
    # entry of repacked blocks is for the models that file does not describe (mixtures of experts).
    to_panels = from_gguf and quantized and arch.num_experts == 0
    fill_cache = from_gguf and tp.is_first and not to_panels  # one writer per entry
    loaded_tensors = {}
    bar = tqdm(total=source.num_tensors, desc=f"Loading {os.path.basename(path)}", unit="tensor",
               disable=not progress, leave=False)
    seen = set()
    covered = getattr(net, "covered_names", lambda n: (n,))  # a stacked (MoE) tensor fills several names
    if not quantized:
        named = source.tensors(dtype)
    elif from_gguf or isinstance(source, _gguf_vlm_source().GGUFVisionLanguageSource):
        named = source.tensors(dtype, quantized=True)
    else:
        named = weight_cache.unflatten_quantized(source.tensors(dtype))
    for name, tensor in named:
        _place(net, name, tensor.to(device))
        if fill_cache:
            loaded_tensors[name] = tensor
        seen.update(covered(name))
        bar.update(1)
    bar.close()
    if not seen:
        raise CorruptModelError(f"{path}: no tensors found")
    missing = sorted(expected - seen)
    if missing:  # the parameters they fill would be left as uninitialized memory
        raise CorruptModelError(f"{path}: missing {len(missing)} weight tensor(s): "
                                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
    if quantized:
        quantized_linear.finalize_quantized(net, dtype)
    if to_panels:
        panel_cache.store(path, tp.rank, tp.size, arch, net)
    if fill_cache:
        weight_cache.store(path, cache_key, arch, loaded_tensors)
    return _loaded(net, arch, path, start, quantized)


def _empty_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend | None) -> torch.nn.Module:
    """The model's modules with uninitialized parameters and computed buffers, checked against the parallel
    layout."""
    settings = expert_parallel_settings()
    arch.check_tensor_parallel(tp_group().size, settings.enabled, settings.redundant_experts)
    cls = model_class(arch.architecture)
    with torch.device("meta"):
        net = cls(arch, attention or standalone_attention_backend(device, dtype))
    _materialize(net, device)
    net = net.to(dtype)
    _reset_buffers(net, device)
    return net


def _loaded(net: torch.nn.Module, arch: ArchConfig, path: str, start: float, move_to_huge_pages: bool,
            release: Callable[[torch.Tensor], None] | None = None) -> LoadedModel:
    if move_to_huge_pages:
        move_panels_to_huge_pages(quantized_linear.quantized_weights(net), release)
    net.eval()
    packed = quantized_linear.quantized_weights(net)
    params = sum(p.numel() for p in net.parameters()) + sum(w.shape.numel() for w in packed)
    size = sum(p.numel() * p.element_size() for p in net.parameters()) + sum(w.nbytes for w in packed)
    return LoadedModel(net, arch, path, params, size, time.perf_counter() - start)


def _place(net: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """net.load_weight, with a tensor that does not fit (a shape the config does not give, a stray name) as
    a one-line error naming it; the caller adds the file."""
    try:
        net.load_weight(name, tensor)
    except ModelFileError:
        raise
    except (ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise CorruptModelError(f"tensor {name} {tuple(tensor.shape)} does not fit the model the config "
                                f"describes ({one_line(exc)})") from None


def _materialize(net: torch.nn.Module, device: torch.device) -> None:
    """`Module.to_empty`, but with plain `torch.empty`: to_empty's `empty_like` of a meta tensor runs torch's
    Python reference ops, whose first use imports torch._dynamo and sympy (2-3 s of a cold start)."""
    for module in net.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                              requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _reset_buffers(net: torch.nn.Module, device: torch.device) -> None:
    """Buffers (rotary tables, frequencies) are computed, not loaded: rebuild them on the real device."""
    from tokenloom.model.layers.rotary import RotaryEmbedding  # lazy: imports the native kernels (layer ops)
    rebuilt: dict[tuple, RotaryEmbedding] = {}  # one table per distinct rotary (Gemma 3: local and global)
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            key = repr(module.args)
            if key not in rebuilt:
                rebuilt[key] = RotaryEmbedding(*module.args).to(device)
            module.cos, module.sin = rebuilt[key].cos, rebuilt[key].sin
        elif isinstance(module, InferenceModule):
            module.rebuild_buffers(device)
