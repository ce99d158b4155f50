"""A worker: one rank's model, KV cache and runner. The executors drive it; it never decides a
request's fate, only computes and (on rank 0) samples.

Start-up runs the phases of `phases.py` by name, in the order of `WORKER_PHASES`, each timed and
logged: the in-process executor calls `run_phase` for each (as vLLM's executor drives its workers
through named phases); a worker process (`worker_proc.py`, the mp executor) runs them all in `load`,
since each rank's phases only meet the other ranks inside collectives they all run (the KV cache's
size is the smallest rank's)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from safetensors.torch import load_file
from torch.distributed import ProcessGroup

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.distributed import weight_sync
from tokenloom.distributed.expert_parallel import init_expert_parallel
from tokenloom.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, tp_group
from tokenloom.heap_trim import release_free_heap
from tokenloom.kv_transfer.rank_reports import group_info
from tokenloom.kv_transfer.worker_hook import ConnectorHook
from tokenloom.model.loader import LoadedModel
from tokenloom.model.loader.tensor_source import TensorSource
from tokenloom.worker.expert_balancer import ExpertBalancer
from tokenloom.worker.forward_path import choose_forward_path
from tokenloom.worker.kv_cache import KVCache, size_kv_cache
from tokenloom.worker.phases import (
    WORKER_PHASES,
    DevicePlan,
    LoadedWeights,
    build_runner,
    dtype_name,
    init_device,
    load_target,
    load_weights,
    measure_memory,
    pick_device,
    trained_length,
)
from tokenloom.worker.runner import ModelRunner
from tokenloom.worker.setup import WorkerSetup
from tokenloom.worker.warm_up import warm_up_runner
from tokenloom.worker.weight_update import WeightUpdateError, arch_at, check_same_shapes, decode_metas
from tokenloom.worker.worker_info import WorkerInfo

logger = logging.getLogger("tokenloom.engine")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, master_port: int | None = None,
                 progress: bool = True, join_group: bool = True):
        """`join_group`: the device phase joins the tensor- and expert-parallel groups (False: the caller has,
        or runs one rank alone)."""
        self.config = config
        self.rank = rank
        self.master_port = master_port
        self.progress = progress and rank == 0
        self.join_group = join_group
        # Each phase's result, in phase order.
        self.plan: DevicePlan | None = None
        self.weights: LoadedWeights | None = None
        self.kv_budget_bytes: int | None = None  # None: --num-blocks fixed the KV cache's size
        self.kv: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.setup: WorkerSetup | None = None
        self.phase_seconds: dict[str, float] = {}
        self.weights_path = config.model.model  # what level-2 sleep reloads on wake: the last path served
        self.sync_group: ProcessGroup | None = None  # a trainer's weight-sync group, once joined
        self.balancer: ExpertBalancer | None = None  # --enable-eplb: re-places the experts between steps

    # ---- start-up ---------------------------------------------------------------------------------------------
    def run_phase(self, name: str) -> None:
        """One start-up phase, after the ones before it in WORKER_PHASES."""
        if name not in WORKER_PHASES:
            raise ValueError(f"unknown worker phase {name!r} (phases: {', '.join(WORKER_PHASES)})")
        start = time.perf_counter()
        getattr(self, f"_{name}")()
        self.phase_seconds[name] = seconds = time.perf_counter() - start
        logger.debug("rank %d: start-up phase %s took %.2f s", self.rank, name, seconds)

    def load(self) -> WorkerInfo:
        """Every start-up phase in order; rank 0's description for the EngineCore."""
        for name in WORKER_PHASES:
            self.run_phase(name)
        return self.info()

    def _init_device(self) -> None:
        if self.join_group:
            parallel = self.config.parallel
            init_tensor_parallel(self.rank, parallel.world_size, parallel.master_addr, self.master_port or 0,
                                 pick_device(self.config.model.device))
            init_expert_parallel(parallel.enable_expert_parallel, parallel.expert_placement_strategy,
                                 parallel.enable_eplb, parallel.redundant_experts)
        self.plan = init_device(self.config)

    def _load_model(self) -> None:
        self.weights = load_weights(self.config, self.plan, self.progress)

    def _measure_memory(self) -> None:
        self.kv_budget_bytes = measure_memory(self.config, self.plan, self.weights)

    def _allocate_kv_cache(self) -> None:
        plan, weights = self.plan, self.weights
        draft = weights.draft.arch if weights.draft is not None else None
        self.kv = size_kv_cache(self.config, weights.target.arch, plan.attention, plan.kv_dtype, plan.device,
                                self.kv_budget_bytes, draft, plan.cuda_graphs,
                                weights.is_encoder, trained_length(weights))

    def _build_runner(self) -> None:
        self.runner = build_runner(self.config, self.plan, self.weights, self.kv)

    def _warm_up(self) -> None:
        seconds = warm_up_runner(self.runner, self.progress)
        kv, plan = self.kv, self.plan
        self.setup = WorkerSetup(self.weights.target, self.runner, plan.device, plan.dtype, kv.num_blocks,
                                 kv.block_size, kv.max_model_len, seconds)
        self.setup.log()
        self.balancer = ExpertBalancer.for_model(self.weights.target.model, self.config.parallel.eplb)

    def info(self) -> WorkerInfo:
        setup = self.setup
        arch = setup.arch
        hook = self.kv_hook
        lora = self.weights.lora
        return WorkerInfo(model_path=str(setup.loaded.path), architecture=arch.architecture,
                          vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
                          eos_token_ids=list(arch.eos_token_ids), device=str(setup.device),
                          dtype=dtype_name(setup.dtype), kv_cache_dtype=dtype_name(setup.runner.kv_caches[0].dtype),
                          num_blocks=setup.num_blocks, block_size=setup.block_size,
                          max_model_len=setup.max_model_len, tensor_parallel_size=tp_group().size,
                          summary=setup.summary(), pooling=setup.runner.pooling,
                          warmup_decode_seconds=setup.warmup_decode_seconds,
                          kv_release_window=setup.kv_release_window,
                          kv_connector=group_info(hook.connector) if hook is not None else None,
                          weights_quantized=setup.weights_quantized, weights_bytes=setup.loaded.bytes,
                          lora_target_shapes=lora.target_shapes if lora is not None else {},
                          num_layers=lora.num_layers if lora is not None else 0)

    # ---- steps ----------------------------------------------------------------------------------------------
    @property
    def kv_hook(self) -> ConnectorHook | None:
        """A KV connector's worker half (tokenloom.kv_transfer), owned by the runner."""
        return self.runner.kv_connector if self.runner is not None else None

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute(step)
        if self.balancer is not None and step.num_scheduled_tokens:
            report = self.balancer.after_step()
            if out is not None:
                out.expert_load = report
        return out

    # ---- weights and memory, between steps (training loops) -----------------------------------------------
    def update_weights_from_path(self, path: str) -> None:
        """Serve the weights at `path` (same architecture and shapes); a refused update changes nothing."""
        self._check_no_lora("weight updates")
        check_same_shapes(self.weights.target.arch, arch_at(path), path)
        self._swap_target(load_target(self.config, self.plan, progress=False, model=path))
        self.weights_path = path

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve `tensors` (every weight, named as in a Hugging Face checkpoint), loaded dense."""
        self._check_no_lora("weight updates")
        source = TensorSource(self.weights.target.arch, tensors)
        try:
            loaded = load_target(self.config, self.plan, progress=False, model="tensors in memory", tensors=source)
        except (ValueError, RuntimeError) as exc:  # a missing name, a wrong shape
            raise WeightUpdateError(f"the sent weights do not fit the serving model: {exc}") from None
        self._swap_target(loaded)

    def update_weights_from_safetensors(self, file: str) -> None:
        """`update_weights_from_tensors` with the tensors of one safetensors file (how the process executor
        hands tensors over)."""
        self.update_weights_from_tensors(load_file(file))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  backend: str) -> None:
        """Join a trainer's weight-sync group at rank `rank_offset + tp rank` (tokenloom.distributed.weight_sync)."""
        self.destroy_weights_update_group()
        self.sync_group = weight_sync.open_group(master_address, master_port, rank_offset + self.rank, world_size,
                                                 backend)

    def update_weights_from_distributed(self, metas_json: str) -> None:
        """Receive each tensor of `metas_json` (a JSON list of {name, dtype, shape}) from the trainer's
        broadcasts, in order, then serve them."""
        if self.sync_group is None:
            raise WeightUpdateError("no weight-sync group: call init_weights_update_group first")
        metas = decode_metas(metas_json)
        tensors = {m.name: weight_sync.receive(self.sync_group, weight_sync.dtype_named(m.dtype), m.shape,
                                               self.plan.device) for m in metas}
        self.update_weights_from_tensors(tensors)

    def destroy_weights_update_group(self) -> None:
        self.sync_group = None

    def sleep(self, level: int) -> None:
        """Give memory back while idle: level 1 drops the KV cache, level 2 the weights too."""
        self._check_no_lora("sleep")
        self.runner = self.kv = self.setup = None
        if level >= 2:
            self.weights = None
        release_free_heap()

    def wake_up(self) -> None:
        """Rebuild what `sleep` dropped: the weights (from the last path served), the KV cache, the runner."""
        if self.weights is None:
            self.weights = load_weights(replace(self.config, model=replace(self.config.model,
                                                                           model=self.weights_path)),
                                        self.plan, progress=False)
        for name in ("allocate_kv_cache", "build_runner", "warm_up"):
            self.run_phase(name)

    def _check_no_lora(self, what: str) -> None:
        """The LoRA slots live on the model's layers and in the runner; rebuilding them under resident adapters
        is not built yet."""
        if self.weights is not None and self.weights.lora is not None:
            raise WeightUpdateError(f"{what}: not available with --enable-lora yet; restart the server instead")

    def _swap_target(self, loaded: LoadedModel) -> None:
        plan, kv = self.plan, self.kv
        self.weights = replace(self.weights, target=loaded)
        forward = choose_forward_path(self.config, plan.device, plan.attention, loaded.model, loaded.arch,
                                      kv.caches, kv.max_model_len, plan.cuda_graphs)
        forward.capture(progress=False)
        self.runner.swap_model(loaded.model, forward)
        self.balancer = ExpertBalancer.for_model(loaded.model, self.config.parallel.eplb)
        release_free_heap()

    def shutdown(self) -> None:
        if self.kv_hook is not None:
            self.kv_hook.connector.close()
        if self.join_group:
            destroy_tensor_parallel()
            init_expert_parallel(False)


def build_worker(config: EngineConfig, progress: bool = True) -> WorkerSetup:
    """This rank's model, KV cache and runner, warmed up, outside an executor (one rank, or a group the caller
    has joined)."""
    worker = Worker(config, progress=progress, join_group=False)
    worker.load()
    return worker.setup
