"""A worker: one rank's model, KV cache and runner. The executors drive it; it never decides a
request's fate, only computes and (on rank 0) samples."""
from __future__ import annotations

import logging

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ModelRunnerOutput, SchedulerOutput
from tokenloom.distributed.expert_parallel import init_expert_parallel
from tokenloom.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, tp_group
from tokenloom.kv_transfer.factory import make_worker_connector
from tokenloom.kv_transfer.rank_reports import group_info
from tokenloom.kv_transfer.worker_hook import ConnectorHook
from tokenloom.worker.setup import _name, build_worker, pick_device
from tokenloom.worker.worker_info import WorkerInfo

logger = logging.getLogger("tokenloom.engine")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, master_port: int | None = None,
                 progress: bool = True):
        self.config = config
        self.rank = rank
        self.master_port = master_port
        self.progress = progress and rank == 0
        self.setup = None
        self.kv_hook: ConnectorHook | None = None  # a KV connector's worker half (tokenloom.kv_transfer)

    def load(self) -> WorkerInfo:
        parallel = self.config.parallel
        init_tensor_parallel(self.rank, parallel.world_size, parallel.master_addr, self.master_port or 0,
                             pick_device(self.config.model.device))
        init_expert_parallel(parallel.enable_expert_parallel, parallel.expert_placement_strategy)
        self.setup = setup = build_worker(self.config, progress=self.progress)
        arch = setup.arch
        connector = make_worker_connector(self.config, setup.loaded.model, setup.runner.kv_caches, setup.block_size,
                                          tp_group().rank, tp_group().size)
        self.kv_hook = ConnectorHook(connector) if connector is not None else None
        return WorkerInfo(model_path=str(setup.loaded.path), architecture=arch.architecture,
                          vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
                          eos_token_ids=list(arch.eos_token_ids), device=str(setup.device), dtype=_name(setup.dtype),
                          kv_cache_dtype=_name(setup.runner.kv_caches[0].dtype), num_blocks=setup.num_blocks,
                          block_size=setup.block_size, max_model_len=setup.max_model_len,
                          tensor_parallel_size=tp_group().size, summary=setup.summary(),
                          pooling=setup.runner.pooling, warmup_decode_seconds=setup.warmup_decode_seconds,
                          kv_release_window=setup.kv_release_window,
                          kv_connector=group_info(connector) if connector is not None else None)

    @property
    def runner(self):
        return self.setup.runner

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.kv_hook is None:
            self.runner.update_states(step)
            return self.runner.execute_model(step)
        return self.kv_hook.execute(step, self.runner)  # loads, saves and publications around the forward

    def shutdown(self) -> None:
        if self.kv_hook is not None:
            self.kv_hook.connector.close()
        destroy_tensor_parallel()
        init_expert_parallel(False)
