"""What the two halves of a KV connector tell each other through the step contract (msgspec, never pickle)."""
from __future__ import annotations

import msgspec


class RemoteLoad(msgspec.Struct, array_like=True):
    """Pull a prompt's KV from a producer into this sequence's blocks (a decode instance)."""

    key: str
    addresses: list[str]  # the producer's ZMQ endpoints (tcp://host:port or ipc://path), one per TP rank
    transfer_id: str
    first_block: int  # blocks before it were prefix-cache hits here: pull the rest only
    block_ids: list[int]  # local destination, one per block pulled
    # True: the request computes in this very step, so its forward waits for each layer as it arrives.
    # False: the pull runs in the background while other requests step; the request waits for `loaded`.
    layerwise: bool = True


class Publish(msgspec.Struct, array_like=True):
    """After this step's forward, offer the first `num_tokens` tokens' KV of sequence `key` for one pull."""

    key: str
    transfer_id: str
    num_tokens: int


class BlockSave(msgspec.Struct, array_like=True):
    """Copy block `block_id` to the offload tier under `name` (before the forward overwrites it)."""

    block_id: int
    name: str


class BlockLoad(msgspec.Struct, array_like=True):
    """Fill block `block_id` of sequence `key` from the offload tier's `name`."""

    key: str
    block_id: int
    name: str


class KVConnectorMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    remote_loads: list[RemoteLoad] = []
    publish: list[Publish] = []
    release: list[str] = []  # transfer ids whose lease ended: stop serving them before blocks are reused
    poll: bool = False  # run the step even without tokens, to hear which transfers were sent
    saves: list[BlockSave] = []
    drops: list[str] = []  # offload names evicted from the tier (its size bound)
    loads: list[BlockLoad] = []

    def __bool__(self) -> bool:
        return bool(self.remote_loads or self.publish or self.release or self.poll or self.saves or self.drops
                    or self.loads)


class KVConnectorOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    sent: list[str] = []  # transfer ids a decoder has pulled: their blocks may be freed
    loaded: list[str] = []  # sequence keys whose pull completed (a background load: now schedulable)
    failed: dict[str, str] = {}  # sequence key -> why its load failed (its computed KV is not valid)


class KVWorkerInfo(msgspec.Struct, kw_only=True):
    """What the worker half reports at start-up."""

    identity: str  # hex digest of the model and KV layout: offloaded blocks are keyed by it
    block_bytes: int  # one block over all layers
    address: str = ""  # a producer's endpoint for pulls (rank 0's)
    addresses: list[str] = []  # a producer's endpoints, one per tensor-parallel rank
