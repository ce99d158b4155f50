"""The two halves of a KV connector. Default methods do nothing, so each connector implements what it uses."""
from __future__ import annotations

from tokenloom.engine.request import Request
from tokenloom.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo


class SchedulerConnector:
    """In the EngineCore, beside the scheduler; sees requests and block ids, never tensors."""

    def on_add(self, request: Request) -> int | None:
        """A new request; returns a first output token already produced elsewhere (a remote prefill's)."""
        return None

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens past the local prefix-cache hit whose KV can be loaded instead of computed."""
        return 0

    def after_allocate(self, request: Request, num_local_tokens: int, num_external_tokens: int) -> None:
        """The request's blocks exist now: plan the load of its external tokens into them."""

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """The request computes num_new_tokens this step (a producer publishes once its prompt is done)."""

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        """(keep its blocks for later, kv_transfer_params for the response)."""
        return False, None

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is about to be reused for something else."""

    def failure_policy(self) -> str:
        """What a failed load does to its request: recompute | fail."""
        return "recompute"

    def build_meta(self) -> KVConnectorMetadata | None:
        """This step's instructions for the worker half (None: nothing)."""
        return None

    def update(self, output: KVConnectorOutput | None) -> None:
        """What the worker half reported after the step."""

    def stats(self) -> dict:
        return {}


class WorkerConnector:
    """Beside the model runner; moves bytes. `before_forward` returns failed loads (key -> why)."""

    def info(self) -> KVWorkerInfo:
        raise NotImplementedError

    def before_forward(self, meta: KVConnectorMetadata) -> dict[str, str]:
        return {}

    def after_forward(self, meta: KVConnectorMetadata, requests: dict) -> list[str]:
        """After the forward (`requests`: the runner's RequestState by key); returns the transfer ids sent
        since the last call."""
        return []

    def close(self) -> None:
        """Stop serving and release sockets and files."""
