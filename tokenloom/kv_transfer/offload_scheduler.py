"""The offload tier's scheduler half: an LRU index of offloaded blocks, bounded by --kv-offloading-size.

Evicted prefix-cache blocks are saved (the worker copies them out before the step's forward reuses
them); a waiting request whose prefix continues past its local cache hit into the tier loads those
blocks instead of computing them. Names are sha256(model identity + the block's hash-chain value),
and the chain already covers the cache salt, so a different model or salt never finds a block.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from tokenloom.config import ConfigError, KVOffloadConfig
from tokenloom.core.kv_connector import SchedulerConnector
from tokenloom.core.kv_metadata import BlockLoad, BlockSave, KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo
from tokenloom.core.request import Request
from tokenloom.kv_transfer.offload_store import list_stored, tier_folder
from tokenloom.scheduler.kv_cache_manager import KVCacheManager


class OffloadScheduler(SchedulerConnector):
    def __init__(self, config: KVOffloadConfig, kv: KVCacheManager, info: KVWorkerInfo):
        self.kv = kv
        self.identity = info.identity.encode()
        self.capacity = int(config.size_gib * 2 ** 30 // info.block_bytes)
        if self.capacity < 1:
            raise ConfigError(f"kv_offloading_size {config.size_gib} GiB holds no block of {info.block_bytes} bytes")
        self.index: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.meta = KVConnectorMetadata()
        self.loading: dict[str, list[str]] = {}  # sequence key -> names loaded this step
        self.num_saved = self.num_loaded = 0
        self.persistent = bool(config.path)
        if config.path:
            for name in list_stored(tier_folder(config.path, info.identity)):
                self._add(name)

    def name(self, block_hash: bytes) -> str:
        return hashlib.sha256(self.identity + block_hash).hexdigest()[:40]

    def _add(self, name: str) -> None:
        self.index[name] = None
        while len(self.index) > self.capacity:
            self.meta.drops.append(self.index.popitem(last=False)[0])

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        name = self.name(block_hash)
        if name in self.index:
            self.index.move_to_end(name)
            return
        self.meta.saves.append(BlockSave(block_id, name))
        self._add(name)
        self.num_saved += 1

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        if request.params.prompt_logprobs is not None:
            return 0
        bs = self.kv.block_size
        first, limit = num_local_tokens // bs, min((request.num_tokens - 1) // bs, len(request.block_hashes))
        count = 0
        while first + count < limit and self.name(request.block_hashes[first + count]) in self.index:
            count += 1
        return count * bs

    def after_allocate(self, request: Request, num_local_tokens: int, num_external_tokens: int,
                       background: bool = False) -> None:
        bs = self.kv.block_size
        first = num_local_tokens // bs
        names = []
        for i in range(first, first + num_external_tokens // bs):
            name = self.name(request.block_hashes[i])
            self.index.move_to_end(name)
            self.meta.loads.append(BlockLoad(request.key, request.block_ids[i], name))
            names.append(name)
        self.loading[request.key] = names
        self.num_loaded += len(names)

    def at_shutdown(self) -> KVConnectorMetadata | None:
        """The disk tier saves the prefix-cache blocks it lacks, most recently used first and no more than it
        holds, so a restart hits prefixes that were never evicted. (Host memory ends with the process.)"""
        if not self.persistent:
            return None
        pool = self.kv.pool
        in_use = [b for b in pool.cached.values() if b.ref_cnt > 0]
        free = [pool.blocks[bid] for bid in reversed(pool.free) if pool.blocks[bid].block_hash is not None]
        recent = [b for b in in_use + free if pool.cached.get(b.block_hash) is b]
        missing = [(b.block_id, self.name(b.block_hash)) for b in recent]
        missing = [(bid, name) for bid, name in missing if name not in self.index][:self.capacity]
        for bid, name in reversed(missing):  # least recent first, so the tier's LRU order stays right
            self.meta.saves.append(BlockSave(bid, name))
            self._add(name)
            self.num_saved += 1
        return self.build_meta()

    def build_meta(self) -> KVConnectorMetadata | None:
        meta, self.meta = self.meta, KVConnectorMetadata()
        return meta if meta else None

    def update(self, output: KVConnectorOutput | None) -> None:
        for key in output.failed if output is not None else ():
            for name in self.loading.get(key, ()):  # unreadable: forget it, the request recomputes
                self.index.pop(name, None)
        self.loading.clear()

    def stats(self) -> dict:
        return {"kv_offload_blocks": len(self.index), "kv_offload_saved": self.num_saved,
                "kv_offload_loaded": self.num_loaded}
