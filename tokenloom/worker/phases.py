"""A worker's start-up, as the phases vLLM's executor drives a worker through, each a function of the
previous phases' typed results:

1. `init_device`: device, dtypes and the attention backend (one instance, chosen from the config);
2. `load_weights`: this rank's share of the model (and a draft model), in the backend's impls;
3. `measure_memory`: the bytes the KV cache may take (a profiled largest step on CUDA, the budget on CPU);
4. `allocate_kv_cache` (`kv_cache.size_kv_cache`): blocks from those bytes, the per-layer tensors;
5. `build_runner`: the runner with everything it uses (backend, forward path, drafter, connector, pooler);
6. `warm_up` (`warm_up.warm_up_runner`): a first prefill and decode, and the CUDA graphs' capture.

`Worker` runs them in this order (`WORKER_PHASES`); `setup.build_worker` runs them outside a worker.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.pooling import PoolingConfig
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.kv_transfer.factory import make_worker_connector
from tokenloom.kv_transfer.worker_hook import ConnectorHook
from tokenloom.lora.adapter_files import load_adapter
from tokenloom.lora.slots import LoRASlots
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.model.layers.attention_select import choose_attention_backend, make_attention_backend
from tokenloom.model.layers.quantized_linear import set_quantized_matmul
from tokenloom.model.loader import LoadedModel, load_model, read_arch_config
from tokenloom.model.loader.tensor_source import TensorSource
from tokenloom.model.lora_slots import ModelLoRA, attach_lora
from tokenloom.model.matmul_dtype import cast_matmul_weights, native_cpu_matmul
from tokenloom.model.pooling_config import pooling_for, sentence_max_length
from tokenloom.model.prepack import can_prepack, prepack_linear_weights
from tokenloom.worker.draft_model import build_drafter, check_draft_vocabulary
from tokenloom.worker.forward_path import choose_forward_path, wants_cuda_graphs
from tokenloom.worker.kv_budget import GiB, kv_budget_bytes, profile_cuda_step
from tokenloom.worker.kv_cache import KVCache, kv_heads_per_rank
from tokenloom.worker.logits_processors import build_logits_processors
from tokenloom.worker.runner import ModelRunner

logger = logging.getLogger("tokenloom.engine")

WORKER_PHASES = ("init_device", "load_model", "measure_memory", "allocate_kv_cache", "build_runner", "warm_up")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


# ---- 1. device ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DevicePlan:
    device: torch.device
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype
    attention: AttentionBackend  # the one instance: the model's impls and the runner's metadata
    cuda_graphs: bool  # decode steps replay CUDA graphs (forward_path.py)


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


def same_or(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """A dtype option whose "auto" means the model dtype (--matmul-dtype, --kv-cache-dtype)."""
    return model_dtype if name == "auto" else _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def init_device(config: EngineConfig) -> DevicePlan:
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    kv_dtype = same_or(config.cache.kv_cache_dtype, dtype)
    name = choose_attention_backend(config.model.attention_backend, device, dtype, kv_dtype, _windowed(config, device))
    torch.manual_seed(config.model.seed)
    attention = make_attention_backend(name)
    return DevicePlan(device, dtype, kv_dtype, attention, wants_cuda_graphs(config, device, attention))


def _windowed(config: EngineConfig, device: torch.device) -> bool:
    """Whether some layer attends within a sliding window (read from the config only where it matters: the
    automatic choice on CUDA, since FlashInfer is not wired to windows yet)."""
    if config.model.attention_backend != "auto" or device.type != "cuda":
        return False
    arch = read_arch_config(config.model.model)
    return any(arch.layer_window(i) is not None for i in range(arch.num_layers))


# ---- 2. weights --------------------------------------------------------------------------------------------
@dataclass
class LoadedWeights:
    target: LoadedModel
    draft: LoadedModel | None  # speculative method "draft_model"
    pooling: PoolingConfig | None  # an embedding engine's (tokenloom/model/pooler.py)
    lora: ModelLoRA | None = None  # the LoRA slots on the target's layers (--enable-lora)

    @property
    def is_encoder(self) -> bool:
        return getattr(self.target.model, "is_encoder", False)


def load_weights(config: EngineConfig, plan: DevicePlan, progress: bool) -> LoadedWeights:
    loaded = load_target(config, plan, progress)
    pooling = pooling_for(config.model.runner, config.model.convert, loaded.model, loaded.path,
                          loaded.arch.hidden_size)
    lora = None
    if config.lora.enable_lora:  # before the memory is measured: the slots' buffers are part of the weights
        slot_dtype = same_or(config.lora.lora_dtype, plan.dtype)
        lora = attach_lora(loaded.model, loaded.arch, config.lora.num_slots, config.lora.max_lora_rank, plan.device,
                           slot_dtype)
        logger.info("LoRA: %d slots of rank %d (%s) on %d projections", config.lora.num_slots,
                    config.lora.max_lora_rank, dtype_name(slot_dtype), len(lora.targets))
    return LoadedWeights(loaded, _load_draft(config, loaded, plan, progress), pooling, lora)


def load_target(config: EngineConfig, plan: DevicePlan, progress: bool, model: str | None = None,
                tensors: TensorSource | None = None) -> LoadedModel:
    """The served model, ready for the runner: from `model` (default the configured one) or from `tensors`
    in memory (a weight update), in the matmul form the config asks for."""
    device, dtype = plan.device, plan.dtype
    mmproj = config.model.mmproj if model is None and tensors is None else None
    loaded = load_model(model or config.model.model, dtype, device, progress=progress, attention=plan.attention,
                        tensors=tensors, mmproj=mmproj)
    if set_quantized_matmul(loaded.model, config.model.quantized_matmul):  # GGUF blocks on the native kernels
        logger.info("quantized weights multiply on the native kernels (%s)", config.model.quantized_matmul)
    matmul_dtype = same_or(config.model.matmul_dtype, dtype)
    if matmul_dtype != dtype:
        if device.type == "cpu" and not native_cpu_matmul(matmul_dtype):
            logger.warning("this CPU has no native %s dot product; %s matmuls will be slower than float32",
                           dtype_name(matmul_dtype), dtype_name(matmul_dtype))
        loaded.bytes = cast_matmul_weights(loaded.model, matmul_dtype)
        logger.info("linear layers compute in %s under %s activations", dtype_name(matmul_dtype), dtype_name(dtype))
    if can_prepack(device):
        logger.info("%d matmul weights prepacked for oneDNN", prepack_linear_weights(loaded.model))
    logger.info("loaded %s: %.1fM parameters, %.0f MiB, %.1fs", loaded.path, loaded.num_params / 1e6,
                loaded.bytes / 2 ** 20, loaded.seconds)
    return loaded


def _load_draft(config: EngineConfig, target: LoadedModel, plan: DevicePlan, progress: bool) -> LoadedModel | None:
    """The draft model of speculative method "draft_model", in the target's dtype and backend, or None."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    draft = load_model(spec.model, plan.dtype, plan.device, progress=progress, attention=plan.attention)
    check_draft_vocabulary(draft.arch, target.arch, spec.model)
    if draft.model is not target.model and can_prepack(plan.device):
        prepack_linear_weights(draft.model)
    logger.info("draft model %s: %.1fM parameters, %.0f MiB, drafting %d tokens per step", draft.path,
                draft.num_params / 1e6, draft.bytes / 2 ** 20, spec.num_speculative_tokens)
    return draft


# ---- 3. memory ---------------------------------------------------------------------------------------------
def measure_memory(config: EngineConfig, plan: DevicePlan, weights: LoadedWeights) -> int | None:
    """Bytes this rank's KV cache may take; None when --num-blocks fixes the count. On CUDA, what a profiled
    largest step leaves of --gpu-memory-utilization (kv_budget.py). On CPU, the machine's --kv-cache-memory
    shared by its ranks (each stores 1/p of the KV heads, so the token capacity is one rank's with all of it)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return None
    if plan.device.type == "cuda":
        profiled = profile_cuda_step(lambda: _profile_forward(weights.target.model, weights.target.arch, config,
                                                              plan), plan.device)
        return kv_budget_bytes(profiled, cache.gpu_memory_utilization)
    return int(cache.kv_cache_memory / config.parallel.ranks_per_node * GiB)


def _profile_forward(model, arch: ArchConfig, config: EngineConfig, plan: DevicePlan) -> None:
    """The largest step the scheduler can emit (a full token budget of prefill, then the logits of a full
    batch), over a scratch KV cache just big enough for it, so the KV budget leaves room for activations."""
    n = config.scheduler.max_num_batched_tokens
    bs = config.cache.block_size
    blocks = -(-n // bs)
    attention, device = plan.attention.another(), plan.device
    caches = [torch.zeros(attention.kv_cache_shape(blocks, bs, kv_heads_per_rank(arch, tp_group().size),
                                                   arch.head_dim), dtype=plan.dtype, device=device)
              for _ in range(arch.num_layers)]
    attention.bind(caches[0])
    positions = torch.arange(n, device=device) % arch.max_position_embeddings
    meta = attention.build_metadata([ScheduledSpan(0, 0, n, list(range(blocks)))], torch.arange(n, device=device))
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=device), positions, caches, meta)
        if not getattr(model, "is_encoder", False):
            model.compute_logits(hidden[-config.scheduler.max_num_seqs:])
    del caches, hidden


# ---- 4. the KV cache's size: kv_cache.size_kv_cache; its trained length for embeddings -------------------------
def trained_length(weights: LoadedWeights) -> int | None:
    """A sentence model's trained sequence length (it caps max_model_len), else None."""
    return sentence_max_length(weights.target.path) if weights.pooling is not None else None


# ---- 5. the runner -----------------------------------------------------------------------------------------
def build_runner(config: EngineConfig, plan: DevicePlan, weights: LoadedWeights, kv: KVCache) -> ModelRunner:
    attention = plan.attention
    attention.bind(kv.caches[0])
    model, arch = weights.target.model, weights.target.arch
    drafter = None
    if weights.draft is not None:
        drafter = build_drafter(weights.draft.model, weights.draft.arch, kv.num_blocks, kv.block_size, plan.kv_dtype,
                                plan.device, attention.another(), config.speculative_config.num_speculative_tokens,
                                kv.max_model_len)
    forward = choose_forward_path(config, plan.device, attention, model, arch, kv.caches, kv.max_model_len,
                                  plan.cuda_graphs)
    group = tp_group()
    connector = make_worker_connector(config, model, kv.caches, kv.block_size, group.rank, group.size)
    processors = build_logits_processors(config, plan.device) if group.rank == 0 else []
    lora = None
    if weights.lora is not None:
        lora = LoRASlots(weights.lora.batch, weights.lora.targets, config.lora.max_lora_rank,
                         config.lora.max_cpu_loras,
                         partial(load_adapter, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads))
    return ModelRunner(model, kv.caches, kv.block_size, plan.device, attention, forward=forward, drafter=drafter,
                       pooling=weights.pooling, kv_connector=ConnectorHook(connector) if connector else None,
                       logits_processors=processors, lora=lora)
