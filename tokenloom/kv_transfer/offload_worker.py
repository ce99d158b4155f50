"""The offload tier's worker half: before the forward, copy blocks about to be reused out, drop what the
tier's bound evicted, and copy hits back in."""
from __future__ import annotations

import torch

from tokenloom.kv_transfer.base import WorkerConnector
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.config import KVOffloadConfig
from tokenloom.kv_transfer.metadata import KVConnectorMetadata, KVWorkerInfo
from tokenloom.kv_transfer.offload_store import DiskStore, HostStore, tier_folder


class OffloadWorker(WorkerConnector):
    def __init__(self, config: KVOffloadConfig, kv_caches: list[torch.Tensor], identity: str, block_bytes: int):
        self.kv_caches = kv_caches
        self.identity = identity
        self.block_bytes = block_bytes
        cache = kv_caches[0]
        self.shape = (len(kv_caches), cache.shape[0], *cache.shape[2:])
        self.dtype = cache.dtype
        self.store = (DiskStore(identity, layout(kv_caches), tier_folder(config.path, identity)) if config.path
                      else HostStore(identity, layout(kv_caches)))

    def info(self) -> KVWorkerInfo:
        return KVWorkerInfo(identity=self.identity, block_bytes=self.block_bytes)

    def before_forward(self, meta: KVConnectorMetadata) -> dict[str, str]:
        for save in meta.saves:
            self.store.put(save.name, torch.stack([cache[:, save.block_id] for cache in self.kv_caches]))
        for name in meta.drops:
            self.store.delete(name)
        failed = {}
        for load in meta.loads:
            block = self.store.get(load.name, self.shape, self.dtype)
            if block is None:
                failed[load.key] = f"offloaded block {load.name} is missing or unreadable"
                continue
            block = block.to(self.kv_caches[0].device)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, load.block_id].copy_(block[layer])
        return failed
