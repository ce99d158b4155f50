"""The offload tier's worker half, layer by layer.

Before the forward, the hits' blocks are read from the store in a background thread (host memory or disk).
Right before layer i touches its cache, an evicted block's layer i is copied out to a host buffer (the step is
about to overwrite it) and each hit's layer i is copied in. After the forward the copied-out blocks go to the
store, and the evicted names leave it, in a background thread that the next step (or close) waits for: the
file writes overlap sampling, scheduling and the next step's preparation instead of delaying the forward.
A hit evicted in the same step is served from its host buffer (the store does not have it yet).
"""
from __future__ import annotations

import threading

import torch

from tokenloom.config import KVOffloadConfig
from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.kv_metadata import BlockLoad, KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.offload_store import DiskStore, HostStore, tier_folder


class OffloadWorker(WorkerConnector):
    def __init__(self, config: KVOffloadConfig, kv_caches: list[torch.Tensor], identity: str, block_bytes: int):
        self.kv_caches = kv_caches
        self.identity = identity
        self.block_bytes = block_bytes
        cache = kv_caches[0]
        self.shape = (len(kv_caches), cache.shape[0], *cache.shape[2:])
        self.dtype = cache.dtype
        self.pinned = cache.is_cuda
        self.store = (DiskStore(identity, layout(kv_caches), tier_folder(config.path, identity)) if config.path
                      else HostStore(identity, layout(kv_caches)))
        self.saving: list[tuple[int, str, torch.Tensor]] = []  # this step's (block id, name, host buffer)
        self.drops: list[str] = []
        self.loads: list[tuple[BlockLoad, torch.Tensor | None]] = []  # (load, its source once read)
        self.reader: threading.Thread | None = None
        self.writer: threading.Thread | None = None
        self.failed: dict[str, str] = {}
        self.loaded: list[str] = []  # keys whose loads all succeeded (with TP, rank 0 counts every rank's)

    def info(self) -> KVWorkerInfo:
        return KVWorkerInfo(identity=self.identity, block_bytes=self.block_bytes)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self._join_writer()  # the previous step's blocks are in the store before anything reads it
        self.saving = [(s.block_id, s.name, torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned))
                       for s in meta.saves]
        self.drops = list(meta.drops)
        staged = {name: buffer for _, name, buffer in self.saving}
        self.loads = [(load, staged.get(load.name)) for load in meta.loads]
        if any(src is None for _, src in self.loads):
            self.reader = threading.Thread(target=self._read, name="kv-offload-read", daemon=True)
            self.reader.start()

    def _read(self) -> None:
        self.loads = [(load, src if src is not None else self.store.get(load.name, self.shape, self.dtype))
                      for load, src in self.loads]

    def has_layer_work(self) -> bool:
        return bool(self.saving or self.loads)

    def wait_for_layer_load(self, layer: int) -> None:
        cache = self.kv_caches[layer]
        for block_id, _, buffer in self.saving:
            buffer[layer].copy_(cache[:, block_id], non_blocking=self.pinned)
        if self.reader is not None:
            self.reader.join()
            self.reader = None
        for load, src in self.loads:
            if src is not None:
                cache[:, load.block_id].copy_(src[layer], non_blocking=self.pinned)
            elif layer == 0:
                self.failed[load.key] = f"offloaded block {load.name} is missing or unreadable"

    def wait_for_save(self, meta: KVConnectorMetadata, requests: dict) -> None:
        if self.saving or self.drops:
            if self.pinned:
                torch.cuda.current_stream().synchronize()  # the copies out are complete before the writer reads
            saving, drops, self.saving, self.drops = self.saving, self.drops, [], []
            self.writer = threading.Thread(target=self._write, args=(saving, drops), name="kv-offload-write",
                                           daemon=True)
            self.writer.start()
        self.loaded = list(dict.fromkeys(load.key for load, _ in self.loads if load.key not in self.failed))
        self.loads = []

    def _write(self, saving: list[tuple[int, str, torch.Tensor]], drops: list[str]) -> None:
        for _, name, buffer in saving:
            self.store.put(name, buffer)
        for name in drops:
            self.store.delete(name)

    def _join_writer(self) -> None:
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        out = KVConnectorOutput(loaded=self.loaded, failed=self.failed)
        self.loaded, self.failed = [], {}
        return out

    def close(self) -> None:
        self._join_writer()
