"""The ZMQ connector's scheduler half: leases on a producer, remote loads on a consumer.

Producer (prefill instance): a request with ``kv_transfer_params={"do_remote_decode": true}`` runs its
prompt and samples one token; the step that completes its prompt asks the worker to publish the
prompt's blocks under a fresh transfer id. When it finishes, its blocks stay held under a lease and
its output carries the params a decoder needs. The lease ends when the worker reports the blocks
sent, or after ``kv_lease_s`` (the decoder never came): then the blocks are freed.

Consumer (decode instance): a request with ``do_remote_prefill`` params takes the producer's first
token as its first output, counts the whole prompt as external tokens (past any local prefix hit),
and its first step pulls those blocks before computing the first token's KV: no prompt token is
computed here. A failed pull follows ``kv_load_failure_policy``.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from tokenloom.config import KVTransferConfig
from tokenloom.core.kv_connector import SchedulerConnector
from tokenloom.core.kv_metadata import KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo, Publish, RemoteLoad
from tokenloom.core.request import Request
from tokenloom.kv_transfer.trust import producer_allowed
from tokenloom.scheduler.kv_cache_manager import KVCacheManager

MAX_TRANSFER_ID = 64  # characters; ours are 32 hex digits
MAX_TP_RANKS = 64  # producer endpoints a decoder accepts in kv_transfer_params


@dataclass
class RemotePrefill:
    addresses: list[str]  # one per producer TP rank
    transfer_id: str
    first_token: int


@dataclass
class Lease:
    block_ids: list[int]
    deadline: float  # time.monotonic()


def _remote_prefill(params: dict, request: Request, allowed: list[str] | None) -> RemotePrefill:
    """The params a producer returned, checked (they come through the client body; the HTTP server took them
    only from a trusted sender, kv_transfer/trust.py); `allowed`: the kv_producers allow-list, if any."""
    address, tid = params.get("remote_address"), params.get("remote_transfer_id")
    first, num = params.get("first_token_id"), params.get("remote_num_tokens")
    addresses = [address] if isinstance(address, str) else address
    if not (isinstance(addresses, list) and 0 < len(addresses) <= MAX_TP_RANKS
            and all(isinstance(a, str) and a.startswith(("tcp://", "ipc://")) and len(a) < 256 for a in addresses)):
        raise ValueError("kv_transfer_params.remote_address must be a tcp:// or ipc:// address "
                         "(or a list of them, one per tensor-parallel rank)")
    outside = [a for a in addresses if allowed is not None and not producer_allowed(a, allowed)]
    if outside:
        raise ValueError(f"kv_transfer_params.remote_address {outside[0]!r} is not among kv_producers")
    if not (isinstance(tid, str) and 0 < len(tid) <= MAX_TRANSFER_ID):
        raise ValueError("kv_transfer_params.remote_transfer_id is missing or too long")
    if not isinstance(first, int) or num != request.num_prompt_tokens:
        raise ValueError(f"kv_transfer_params do not match this prompt ({num!r} remote tokens, "
                         f"{request.num_prompt_tokens} here) or lack first_token_id")
    return RemotePrefill(addresses, tid, first)


class ZmqScheduler(SchedulerConnector):
    def __init__(self, config: KVTransferConfig, kv: KVCacheManager, info: KVWorkerInfo):
        self.config = config
        self.kv = kv
        self.address = info.address
        self.addresses = info.addresses or [info.address]
        self.remote: dict[str, RemotePrefill] = {}  # consumer: by sequence key, until its load is planned
        self.pulling: set[str] = set()  # consumer: keys whose pull runs in the background
        self.orphans: dict[str, list[int]] = {}  # their blocks, held past the request's end until the pull ends
        self.producing: dict[str, str] = {}  # producer: sequence key -> transfer id
        self.published: set[str] = set()
        self.leases: dict[str, Lease] = {}  # transfer id -> held blocks
        self.meta = KVConnectorMetadata()
        self.num_sent = 0
        self.num_expired = 0

    def on_add(self, request: Request) -> int | None:
        params = request.params.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            if not self.config.is_producer:
                raise ValueError("this instance is not a KV producer (start it with --splitwise-role prefill)")
            if request.params.n != 1 or (request.params.best_of or 1) != 1:
                raise ValueError("a request for remote decode must have n = 1")
            self.producing[request.key] = uuid.uuid4().hex
        elif params.get("do_remote_prefill"):
            if not self.config.is_consumer:
                raise ValueError("this instance is not a KV consumer (start it with --splitwise-role decode)")
            remote = _remote_prefill(params, request, self.config.kv_producers)
            self.remote[request.key] = remote
            return remote.first_token
        return None

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        return request.num_prompt_tokens - num_local_tokens if request.key in self.remote else 0

    def load_in_background(self, request: Request, others_computing: bool) -> bool:
        """In the background while others compute (their decode steps go on); else within the request's own
        step, layer by layer, which is the shortest way to its next token when nothing else waits."""
        return others_computing

    def after_allocate(self, request: Request, num_local_tokens: int, num_external_tokens: int,
                       background: bool = False) -> None:
        remote = self.remote.pop(request.key)  # one try: a failed load recomputes or fails, never re-pulls
        bs = self.kv.block_size
        first = num_local_tokens // bs
        last = -(-(num_local_tokens + num_external_tokens) // bs)
        self.meta.remote_loads.append(RemoteLoad(request.key, remote.addresses, remote.transfer_id, first,
                                                 request.block_ids[first:last], layerwise=not background))
        if background:
            self.pulling.add(request.key)

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        tid = self.producing.get(request.key)
        if (tid and tid not in self.published
                and request.num_computed_tokens + num_new_tokens >= request.num_prompt_tokens):
            self.published.add(tid)
            self.meta.publish.append(Publish(request.key, tid, request.num_prompt_tokens))

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        self.remote.pop(request.key, None)
        if request.key in self.pulling:  # the puller may still write into its blocks: free them when it is done
            self.orphans[request.key] = request.block_ids[request.num_released_blocks:]
            return True, None
        tid = self.producing.pop(request.key, None)
        if tid is None or tid not in self.published:
            return False, None
        self.published.discard(tid)
        if request.finish_reason in ("abort", "error") or not request.output_token_ids:
            self.meta.release.append(tid)
            return False, None
        self.leases[tid] = Lease(list(request.block_ids), time.monotonic() + self.config.kv_lease_s)
        address = self.address if len(self.addresses) == 1 else self.addresses
        return True, {"do_remote_prefill": True, "remote_address": address, "remote_transfer_id": tid,
                      "remote_num_tokens": request.num_prompt_tokens,
                      "first_token_id": request.output_token_ids[0]}

    def failure_policy(self) -> str:
        return self.config.kv_load_failure_policy

    def build_meta(self) -> KVConnectorMetadata | None:
        now = time.monotonic()
        for tid in [t for t, lease in self.leases.items() if lease.deadline < now]:
            self.kv.pool.release(self.leases.pop(tid).block_ids)
            self.meta.release.append(tid)
            self.num_expired += 1
        self.meta.poll = bool(self.leases or self.pulling)
        meta, self.meta = self.meta, KVConnectorMetadata()
        return meta if meta else None

    def update(self, output: KVConnectorOutput | None) -> None:
        if output is None:
            return
        for key in [*output.loaded, *output.failed]:
            self.pulling.discard(key)
            blocks = self.orphans.pop(key, None)
            if blocks is not None:
                self.kv.pool.release(blocks)
        for tid in output.sent:
            lease = self.leases.pop(tid, None)
            if lease is not None:
                self.kv.pool.release(lease.block_ids)
                self.num_sent += 1

    def stats(self) -> dict:
        return {"kv_transfer_leases": len(self.leases), "kv_transfer_pulling": len(self.pulling),
                "kv_transfer_sent": self.num_sent,
                "kv_transfer_expired": self.num_expired}
