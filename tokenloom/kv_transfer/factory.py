"""Build a connector's halves from the engine configuration (None when no connector is configured)."""
from __future__ import annotations

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.kv_connector import SchedulerConnector, WorkerConnector
from tokenloom.core.kv_metadata import KVWorkerInfo
from tokenloom.kv_transfer.blocks import model_identity
from tokenloom.kv_transfer.offload_scheduler import OffloadScheduler
from tokenloom.kv_transfer.offload_worker import OffloadWorker
from tokenloom.kv_transfer.pd_scheduler import ZmqScheduler
from tokenloom.kv_transfer.pd_worker import ZmqWorker
from tokenloom.scheduler.kv_cache_manager import KVCacheManager


def make_worker_connector(config: EngineConfig, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                          block_size: int, tp_rank: int = 0, tp_size: int = 1) -> WorkerConnector | None:
    transfer, offload = config.kv_transfer_config, config.kv_offload_config
    if transfer is None and offload is None:
        return None
    identity = model_identity(model, kv_caches, tp_rank, tp_size)
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
    if transfer is not None:
        return ZmqWorker(transfer, kv_caches, block_size, identity, block_bytes, tp_rank, tp_size)
    return OffloadWorker(offload, kv_caches, identity, block_bytes)


def make_scheduler_connector(config: EngineConfig, kv: KVCacheManager,
                             info: KVWorkerInfo | None) -> SchedulerConnector | None:
    if info is None:
        return None
    if config.kv_transfer_config is not None:
        return ZmqScheduler(config.kv_transfer_config, kv, info)
    connector = OffloadScheduler(config.kv_offload_config, kv, info)
    kv.pool.on_evict = connector.on_evict
    return connector
