"""The ZMQ connector's worker half: a producer serves published blocks; a consumer pulls them.

A consumer's pulls begin before the forward and run in the puller's thread. A pull for a request computed in
this same step (`RemoteLoad.layerwise`) is waited for layer by layer, so layer i computes while layers > i
still arrive; any other pull completes in the background while the other requests keep stepping, and is
reported `loaded` (or failed) once done. Each tensor-parallel rank moves its own shard of the KV heads:
rank r pulls from the producer's rank r, whose server checks that both sides have the same TP size.
"""
from __future__ import annotations

import torch

from tokenloom.config import KVTransferConfig
from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.kv_metadata import KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo, RemoteLoad
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.puller import KVPuller, Pull
from tokenloom.kv_transfer.transport import KVServer, PullRequest

# How long a step that computed nothing waits for a background pull to complete before returning (the engine
# polls with such steps while requests wait for their KV): short enough not to delay a new request's
# admission noticeably, long enough not to spin a core.
IDLE_WAIT_S = 0.01


class ZmqWorker(WorkerConnector):
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], block_size: int, identity: str,
                 block_bytes: int, tp_rank: int = 0, tp_size: int = 1):
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.identity = identity
        self.block_bytes = block_bytes
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layout = layout(kv_caches)
        self.server = (KVServer(kv_caches, identity, config.kv_ip, config.kv_port, config.kv_transport,
                                tp_rank, tp_size) if config.is_producer else None)
        self.puller = KVPuller(kv_caches) if config.is_consumer else None
        self.in_step: list[Pull] = []  # this step's layerwise pulls
        self.in_flight = 0  # pulls started and not yet reported
        self.refused: dict[str, str] = {}  # loads refused before they started (key -> why)

    def info(self) -> KVWorkerInfo:
        address = self.server.address if self.server else ""
        return KVWorkerInfo(identity=self.identity, block_bytes=self.block_bytes, address=address,
                            addresses=[address] if address else [])

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if meta.release and self.server is not None:
            self.server.release(meta.release)
        self.in_step = []
        for load in meta.remote_loads:
            if len(load.addresses) != self.tp_size:
                self.refused[load.key] = (f"tensor-parallel mismatch: the producer serves {len(load.addresses)} "
                                          f"rank(s), this decoder runs {self.tp_size}")
                continue
            pull = self.puller.start(load.key, load.addresses[self.tp_rank], self._request(load), load.block_ids,
                                     self.config.kv_transfer_timeout_s)
            self.in_flight += 1
            if load.layerwise:
                self.in_step.append(pull)

    def _request(self, load: RemoteLoad) -> PullRequest:
        return PullRequest(transfer_id=load.transfer_id, identity=self.identity, layout=self.layout,
                           first_block=load.first_block, num_blocks=len(load.block_ids),
                           tp_rank=self.tp_rank, tp_size=self.tp_size)

    def has_layer_work(self) -> bool:
        return bool(self.in_step)

    def wait_for_layer_load(self, layer: int) -> None:
        for pull in self.in_step:
            self.puller.wait_layer(pull, layer)

    def wait_for_save(self, meta: KVConnectorMetadata, requests: dict) -> None:
        """A producer offers the prompts completed in this step (its blocks are served from the cache itself,
        zero-copy, when the decoder asks: nothing is saved per layer)."""
        self.in_step = []
        if self.server is None:
            return
        for p in meta.publish:
            state = requests.get(p.key)
            if state is not None:
                blocks = state.block_ids[:-(-p.num_tokens // self.block_size)]
                self.server.publish(p.transfer_id, blocks, self.config.kv_lease_s)

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        out = KVConnectorOutput(sent=self.server.take_sent() if self.server is not None else [])
        out.failed, self.refused = self.refused, {}
        if self.puller is None:
            return out
        if idle and self.in_flight:
            self.puller.wait_any(IDLE_WAIT_S)
        for pull in self.puller.take_done():
            self.in_flight -= 1
            if pull.error:
                out.failed[pull.key] = pull.error
            else:
                out.loaded.append(pull.key)
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()
