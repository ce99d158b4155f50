"""The ZMQ connector's worker half: a producer serves published blocks; a consumer pulls before its forward."""
from __future__ import annotations

import torch

from tokenloom.kv_transfer.base import WorkerConnector
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.config import KVTransferConfig
from tokenloom.kv_transfer.metadata import KVConnectorMetadata, KVWorkerInfo
from tokenloom.kv_transfer.transport import KVServer, PullRequest, pull


class ZmqWorker(WorkerConnector):
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], block_size: int, identity: str,
                 block_bytes: int):
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.identity = identity
        self.block_bytes = block_bytes
        self.layout = layout(kv_caches)
        self.server = (KVServer(kv_caches, identity, config.kv_ip, config.kv_port, config.kv_transport)
                       if config.is_producer else None)

    def info(self) -> KVWorkerInfo:
        return KVWorkerInfo(identity=self.identity, block_bytes=self.block_bytes,
                            address=self.server.address if self.server else "")

    def before_forward(self, meta: KVConnectorMetadata) -> dict[str, str]:
        if meta.release and self.server is not None:
            self.server.release(meta.release)
        failed = {}
        for load in meta.remote_loads:
            request = PullRequest(transfer_id=load.transfer_id, identity=self.identity, layout=self.layout,
                                  first_block=load.first_block, num_blocks=len(load.block_ids))
            error = pull(load.address, request, self.kv_caches, load.block_ids, self.config.kv_transfer_timeout_s)
            if error:
                failed[load.key] = error
        return failed

    def after_forward(self, meta: KVConnectorMetadata, requests: dict) -> list[str]:
        if self.server is None:
            return []
        for p in meta.publish:
            state = requests.get(p.key)
            if state is not None:
                blocks = state.block_ids[:-(-p.num_tokens // self.block_size)]
                self.server.publish(p.transfer_id, blocks, self.config.kv_lease_s)
        return self.server.take_sent()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
