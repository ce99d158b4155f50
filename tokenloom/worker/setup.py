"""A worker's start-up: pick device and dtype, load this rank's share of the weights, size and allocate
its KV cache, build the runner. The block pool that hands those blocks out lives in the EngineCore."""
from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.distributed.parallel_state import all_reduce_min, tp_group
from tokenloom.heap_trim import release_free_heap
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import (
    AttentionBackend,
    ScheduledSpan,
    select_attention_backend,
    selected_attention_backend,
)
from tokenloom.model.layers.quantized_linear import set_quantized_matmul
from tokenloom.model.loader import LoadedModel, load_model, read_arch_config
from tokenloom.model.matmul_dtype import cast_matmul_weights, native_cpu_matmul
from tokenloom.model.native_stack import NativeStack
from tokenloom.model.pooling_config import pooling_for, sentence_max_length
from tokenloom.model.prepack import can_prepack, prepack_linear_weights
from tokenloom.worker.cuda_graphs import DecodeGraphs, capture_sizes
from tokenloom.worker.draft_model import build_drafter, check_draft_vocabulary
from tokenloom.worker.kv_budget import ProfiledMemory, kv_blocks, profile_cuda_step
from tokenloom.worker.runner import ModelRunner

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
    warmup_decode_seconds: float = 0.0  # the warm-up's one-sequence decode step: the machine's speed at start

    @property
    def arch(self) -> ArchConfig:
        return self.loaded.arch

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks * self.block_size // self.max_model_len

    @property
    def kv_release_window(self) -> int | None:
        """The sliding window, when every layer attends within it: the scheduler frees blocks behind it."""
        return self.arch.sliding_window if self.arch.all_layers_windowed else None

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


def kv_cache_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    return _same_or(config.cache.kv_cache_dtype, pick_dtype(config.model.dtype, device))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_heads_per_rank(arch: ArchConfig, tp_size: int) -> int:
    """KV heads a rank stores: its share, or one replicated head when there are more ranks than heads."""
    return max(1, arch.num_kv_heads // tp_size)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    return 2 * arch.num_layers * block_size * kv_heads_per_rank(arch, tp_size) * arch.head_dim * dtype.itemsize


def _count_blocks(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype,
                  profiled: ProfiledMemory | None, draft: ArchConfig | None = None) -> int:
    """`profiled` is the GPU's memory around the largest step (None on CPU); a draft model's cache has one
    block per target block, so its bytes count in every block."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(arch, cache.block_size, dtype, tp_group().size)
    if draft is not None:
        per_block += kv_bytes_per_block(draft, cache.block_size, dtype)
    if profiled is not None:
        return kv_blocks(profiled, cache.gpu_memory_utilization, per_block)
    # The CPU budget is the machine's: its ranks share it (each stores 1/p of the KV heads, so the token
    # capacity is the same as one rank's with the whole budget).
    share = cache.kv_cache_memory / config.parallel.ranks_per_node
    return max(int(share * 2 ** 30 // per_block), 2)


def build_worker(config: EngineConfig, progress: bool = True) -> WorkerSetup:
    """This rank's model, KV cache and runner (the tensor-parallel group is already joined)."""
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    backend = select_attention_backend(config.model.attention_backend, device, dtype,
                                       kv_cache_dtype(config, device), _windowed(config, device))
    torch.manual_seed(config.model.seed)
    loaded = load_model(config.model.model, dtype, device, progress=progress)
    arch = loaded.arch
    # Embeddings (tokenloom/model/pooler.py): the runner pools the model's hidden states when this is set.
    pooling = pooling_for(config.model.runner, config.model.convert, loaded.model, loaded.path, arch.hidden_size)
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
    draft = _load_draft(config, loaded, dtype, device, progress)
    profiled = None
    if device.type == "cuda" and config.cache.num_blocks is None:
        profiled = profile_cuda_step(lambda: _profile_forward(loaded.model, arch, config, device, dtype), device)
    kv_dtype = kv_cache_dtype(config, device)
    num_blocks = all_reduce_min(_count_blocks(config, arch, kv_dtype, profiled,  # every rank holds as many
                                              draft.arch if draft is not None else None))
    attention = selected_attention_backend()
    graphs = wants_cuda_graphs(config, device, attention)
    # With graphs, one block more than the pool hands out: the padding rows' scratch block.
    shape = attention.kv_cache_shape(num_blocks + graphs, block_size, kv_heads_per_rank(arch, tp_group().size),
                                     arch.head_dim)
    if getattr(loaded.model, "is_encoder", False):  # never read nor written: views of one element, no memory
        kv_caches = [torch.zeros((), dtype=kv_dtype, device=device).expand(shape) for _ in range(arch.num_layers)]
    else:
        kv_caches = [allocate_kv_cache(shape, kv_dtype, device) for _ in range(arch.num_layers)]
    max_len = min(arch.max_position_embeddings, config.model.max_model_len or arch.max_position_embeddings)
    if config.model.max_model_len and config.model.max_model_len > arch.max_position_embeddings:
        raise ConfigError(f"max_model_len {config.model.max_model_len} is longer than the model's context "
                          f"({arch.max_position_embeddings})")
    trained = sentence_max_length(loaded.path) if pooling is not None else None
    if trained and trained < max_len and not config.model.max_model_len:
        max_len = trained
    capacity = num_blocks * block_size
    # A windowed model frees blocks behind the window: a request holds its window and one step's tokens.
    window = arch.sliding_window if arch.all_layers_windowed else None
    window_fits = window is not None and window + config.scheduler.max_num_batched_tokens + 2 * block_size <= capacity
    if max_len > capacity and not window_fits:
        logger.warning("max_model_len clamped from %d to %d: the KV cache holds only %d tokens "
                       "(raise --kv-cache-memory or --num-blocks)", max_len, capacity, capacity)
        max_len = capacity
    attention.bind(kv_caches[0])
    runner = ModelRunner(loaded.model, kv_caches, block_size, device, attention)
    if draft is not None:
        runner.drafter = build_drafter(draft.model, draft.arch, num_blocks, block_size, kv_dtype, device,
                                       config.speculative_config.num_speculative_tokens, max_len)
    runner.pooling = pooling
    setup = WorkerSetup(loaded, runner, device, dtype, num_blocks, block_size, max_len)
    setup.warmup_decode_seconds = _warm_up(loaded.model, kv_caches, block_size, device, attention, progress)
    if graphs:
        runner.graphs = capture_decode_graphs(loaded.model, kv_caches, arch, config, max_len, progress)
    elif device.type == "cpu" and not config.model.enforce_eager:
        runner.native_stack = NativeStack.build(loaded.model, attention.name)
    release_free_heap()  # what loading and the warm-up freed (5 MiB on the embedded model): heap_trim.py
    if tp_group().is_first:
        logger.info("attention backend: %s", backend)
        logger.info(setup.summary())
    return setup


def wants_cuda_graphs(config: EngineConfig, device: torch.device, attention) -> bool:
    if device.type != "cuda" or config.model.enforce_eager:
        return False
    if attention.name != "flashinfer":
        logger.info("decode steps run eagerly: CUDA graphs need the flashinfer attention backend")
        return False
    return True


def capture_decode_graphs(model, kv_caches, arch: ArchConfig, config: EngineConfig, max_len: int,
                          progress: bool) -> DecodeGraphs:
    tp = tp_group().size
    sizes = capture_sizes(config.scheduler.max_num_seqs, config.model.cuda_graph_sizes)
    graphs = DecodeGraphs(model, kv_caches, scratch_block=kv_caches[0].shape[1] - 1, sizes=sizes,
                          max_blocks_per_seq=-(-max_len // config.cache.block_size))
    graphs.capture((arch.num_heads // tp, kv_heads_per_rank(arch, tp), arch.head_dim), progress)
    return graphs


def _load_draft(config: EngineConfig, target: LoadedModel, dtype: torch.dtype, device: torch.device,
                progress: bool) -> LoadedModel | None:
    """The draft model of speculative method "draft_model", in the target's dtype, or None."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    draft = load_model(spec.model, dtype, device, progress=progress)
    check_draft_vocabulary(draft.arch, target.arch, spec.model)
    if draft.model is not target.model and can_prepack(device):
        prepack_linear_weights(draft.model)
    logger.info("draft model %s: %.1fM parameters, %.0f MiB, drafting %d tokens per step", draft.path,
                draft.num_params / 1e6, draft.bytes / 2 ** 20, spec.num_speculative_tokens)
    return draft


def _windowed(config: EngineConfig, device: torch.device) -> bool:
    """Whether some layer attends within a sliding window (read from the config only where it matters: the
    automatic choice on CUDA, since FlashInfer is not wired to windows yet)."""
    if config.model.attention_backend != "auto" or device.type != "cuda":
        return False
    arch = read_arch_config(config.model.model)
    return any(arch.layer_window(i) is not None for i in range(arch.num_layers))


def allocate_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, zero-filled. On CPU it is a fresh anonymous mapping: it reads as zeros and the
    kernel backs a page with memory only when a block on it is first written, so start-up does not fault in
    (and the process does not hold) the whole budget. torch.zeros wrote every page: ~0.5 s and its full size in
    RSS for the default 2 GiB, before the first request (docs/performance.md, "Memory")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


@torch.inference_mode()
def _warm_up(model, kv_caches, block_size: int, device, attention: AttentionBackend, progress: bool) -> float:
    """One small prefill and one decode through the backend's own metadata, so the first request does not pay
    for lazy initialisation (oneDNN primitives, the thread pool, SDPA's first call). They write blocks 0 and
    1, zeroed again after. Returns the decode's seconds (admission's first guess of the engine's speed, before
    any request is measured)."""
    if getattr(model, "is_encoder", False):  # no KV cache, no head: one whole short sequence
        model(torch.zeros(8, dtype=torch.long, device=device), torch.arange(8, device=device))
        return 0.0
    with tqdm(total=2, desc="Warming up", unit="pass", disable=not progress, leave=False) as bar:
        n = min(8, block_size)
        blocks = [0, 1]
        slots = torch.arange(n, device=device)
        meta = attention.build_metadata([ScheduledSpan(0, 0, n, blocks)], slots)
        model.compute_logits(model(torch.zeros(n, dtype=torch.long, device=device), slots, kv_caches, meta)[-1:])
        bar.update(1)
        position = torch.tensor([n], device=device)
        meta = attention.build_metadata([ScheduledSpan(0, n, 1, blocks)], position)
        seconds = float("inf")
        for _ in range(2):  # the first call pays for lazy set-up; the faster of two is the step's time
            start = time.perf_counter()
            model.compute_logits(model(torch.zeros(1, dtype=torch.long, device=device), position, kv_caches, meta))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = min(seconds, time.perf_counter() - start)
        bar.update(1)
    for cache in kv_caches:
        cache[:, :2].zero_()
    return seconds


def _profile_forward(model, arch: ArchConfig, config: EngineConfig, device, dtype) -> None:
    """The largest step the scheduler can emit (a full token budget of prefill, then the logits of a full
    batch), over a scratch KV cache just big enough for it, so the KV budget leaves room for activations.
    The step's metadata comes from the selected backend, whose impls the model's layers are."""
    n = config.scheduler.max_num_batched_tokens
    bs = config.cache.block_size
    blocks = -(-n // bs)
    attention = selected_attention_backend()
    caches = [torch.zeros(attention.kv_cache_shape(blocks, bs, kv_heads_per_rank(arch, tp_group().size),
                                                   arch.head_dim), dtype=dtype, device=device)
              for _ in range(arch.num_layers)]
    attention.bind(caches[0])
    positions = torch.arange(n, device=device) % arch.max_position_embeddings
    meta = attention.build_metadata([ScheduledSpan(0, 0, n, list(range(blocks)))], torch.arange(n, device=device))
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=device), positions, caches, meta)
        if not getattr(model, "is_encoder", False):
            model.compute_logits(hidden[-config.scheduler.max_num_seqs:])
    del caches, hidden
