"""A worker's start-up: pick device and dtype, load this rank's share of the weights, size and allocate
its KV cache, build the runner. The block pool that hands those blocks out lives in the EngineCore."""
from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.distributed.parallel_state import all_reduce_min, tp_group
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention import AttentionMetadata, PrefillChunk
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan, select_attention_backend, \
    selected_attention_backend
from tokenloom.model.layers.quantized_linear import set_quantized_matmul
from tokenloom.model.loader import LoadedModel, load_model
from tokenloom.model.matmul_dtype import cast_matmul_weights, native_cpu_matmul
from tokenloom.model.prepack import can_prepack, prepack_linear_weights
from tokenloom.model.runner import ModelRunner

logger = logging.getLogger("tokenloom.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerSetup:
    loaded: LoadedModel
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def arch(self) -> ArchConfig:
        return self.loaded.arch

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks * self.block_size // self.max_model_len

    def summary(self) -> str:
        kv_dtype = _name(self.runner.kv_caches[0].dtype)
        return (f"KV cache ({kv_dtype}): {self.num_blocks} blocks of {self.block_size} tokens; "
                f"{self.full_length_requests} requests of {self.max_model_len} tokens fit")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def _same_or(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """A dtype option whose "auto" means the model dtype (--matmul-dtype, --kv-cache-dtype)."""
    return model_dtype if name == "auto" else _DTYPES[name]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_heads_per_rank(arch: ArchConfig, tp_size: int) -> int:
    """KV heads a rank stores: its share, or one replicated head when there are more ranks than heads."""
    return max(1, arch.num_kv_heads // tp_size)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    return 2 * arch.num_layers * block_size * kv_heads_per_rank(arch, tp_size) * arch.head_dim * dtype.itemsize


def _count_blocks(config: EngineConfig, arch: ArchConfig, device: torch.device, dtype: torch.dtype) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(arch, cache.block_size, dtype, tp_group().size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        peak = torch.cuda.max_memory_allocated(device)
        budget = total * cache.gpu_memory_utilization - used_by_others - peak
        return max(int(budget // per_block), 2)
    # The CPU budget is the machine's: its ranks share it (each stores 1/p of the KV heads, so the token
    # capacity is the same as one rank's with the whole budget).
    share = cache.kv_cache_memory / config.parallel.ranks_per_node
    return max(int(share * 2 ** 30 // per_block), 2)


def build_worker(config: EngineConfig, progress: bool = True) -> WorkerSetup:
    """This rank's model, KV cache and runner (the tensor-parallel group is already joined)."""
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    backend = select_attention_backend(config.model.attention_backend, device, dtype)
    torch.manual_seed(config.model.seed)
    loaded = load_model(config.model.model, dtype, device, progress=progress)
    arch = loaded.arch
    if set_quantized_matmul(loaded.model, config.model.quantized_matmul):  # GGUF blocks on the native kernels
        logger.info("quantized weights multiply on the native kernels (%s)", config.model.quantized_matmul)
    matmul_dtype = _same_or(config.model.matmul_dtype, dtype)
    if matmul_dtype != dtype:
        if device.type == "cpu" and not native_cpu_matmul(matmul_dtype):
            logger.warning("this CPU has no native %s dot product; %s matmuls will be slower than float32",
                           _name(matmul_dtype), _name(matmul_dtype))
        loaded.bytes = cast_matmul_weights(loaded.model, matmul_dtype)
        logger.info("linear layers compute in %s under %s activations", _name(matmul_dtype), _name(dtype))
    if can_prepack(device):
        logger.info("%d matmul weights prepacked for oneDNN", prepack_linear_weights(loaded.model))
    logger.info("loaded %s: %.1fM parameters, %.0f MiB, %.1fs", loaded.path, loaded.num_params / 1e6,
                loaded.bytes / 2 ** 20, loaded.seconds)
    block_size = config.cache.block_size
    if device.type == "cuda":
        _profile_forward(loaded.model, arch, config, device, dtype)
    kv_dtype = _same_or(config.cache.kv_cache_dtype, dtype)
    num_blocks = all_reduce_min(_count_blocks(config, arch, device, kv_dtype))  # every rank holds as many
    attention = selected_attention_backend()
    shape = attention.kv_cache_shape(num_blocks, block_size, kv_heads_per_rank(arch, tp_group().size),
                                     arch.head_dim)
    kv_caches = [allocate_kv_cache(shape, kv_dtype, device) for _ in range(arch.num_layers)]
    max_len = min(arch.max_position_embeddings, config.model.max_model_len or arch.max_position_embeddings)
    if config.model.max_model_len and config.model.max_model_len > arch.max_position_embeddings:
        raise ConfigError(f"max_model_len {config.model.max_model_len} is longer than the model's context "
                          f"({arch.max_position_embeddings})")
    window = arch.sliding_window
    if window and window < max_len:
        logger.warning("max_model_len clamped from %d to %d: the model attends over a sliding window of %d "
                       "tokens, which tokenloom does not implement yet; within the window its attention is exact",
                       max_len, window, window)
        max_len = window
    capacity = num_blocks * block_size
    if max_len > capacity:
        logger.warning("max_model_len clamped from %d to %d: the KV cache holds only %d tokens "
                       "(raise --kv-cache-memory or --num-blocks)", max_len, capacity, capacity)
        max_len = capacity
    attention.bind(kv_caches[0])
    runner = ModelRunner(loaded.model, kv_caches, block_size, device, attention)
    setup = WorkerSetup(loaded, runner, device, dtype, num_blocks, block_size, max_len)
    _warm_up(loaded.model, kv_caches, block_size, device, attention, progress)
    if tp_group().is_first:
        logger.info("attention backend: %s", backend)
        logger.info(setup.summary())
    return setup


def allocate_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, zero-filled. On CPU it is a fresh anonymous mapping: it reads as zeros and the
    kernel backs a page with memory only when a block on it is first written, so start-up does not fault in
    (and the process does not hold) the whole budget. torch.zeros wrote every page: ~0.5 s and its full size in
    RSS for the default 2 GiB, before the first request (PERFORMANCE.md, "Start-up and memory")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


@torch.inference_mode()
def _warm_up(model, kv_caches, block_size: int, device, attention: AttentionBackend, progress: bool) -> None:
    """One small prefill and one decode through the backend's own metadata, so the first request does not pay
    for lazy initialisation (oneDNN primitives, the thread pool, SDPA's first call). They write blocks 0 and
    1, zeroed again after."""
    with tqdm(total=2, desc="Warming up", unit="pass", disable=not progress, leave=False) as bar:
        n = min(8, block_size)
        blocks = [0, 1]
        slots = torch.arange(n, device=device)
        meta = attention.build_metadata([ScheduledSpan(0, 0, n, blocks)], slots)
        model.compute_logits(model(torch.zeros(n, dtype=torch.long, device=device), slots, kv_caches, meta)[-1:])
        bar.update(1)
        position = torch.tensor([n], device=device)
        meta = attention.build_metadata([ScheduledSpan(0, n, 1, blocks)], position)
        model.compute_logits(model(torch.zeros(1, dtype=torch.long, device=device), position, kv_caches, meta))
        bar.update(1)
    for cache in kv_caches:
        cache[:, :2].zero_()


def _profile_forward(model, arch: ArchConfig, config: EngineConfig, device, dtype) -> None:
    """Run one max-size forward so the KV budget leaves room for activations."""
    n = config.scheduler.max_num_batched_tokens
    bs = config.cache.block_size
    blocks = -(-n // bs)
    caches = [torch.zeros(2, blocks, bs, kv_heads_per_rank(arch, tp_group().size), arch.head_dim, dtype=dtype,
                          device=device)
              for _ in range(arch.num_layers)]
    meta = AttentionMetadata(torch.arange(n, device=device), 0, None, None, None,
                             [PrefillChunk(0, n, n, torch.arange(blocks, device=device))])
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device) % 
                       arch.max_position_embeddings, caches, meta)
        model.compute_logits(hidden[-config.scheduler.max_num_seqs:])
    del caches, hidden
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
