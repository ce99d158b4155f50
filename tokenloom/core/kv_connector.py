"""The two halves of a KV connector. Default methods do nothing, so each connector implements what it uses."""
from __future__ import annotations

from tokenloom.core.kv_metadata import KVConnectorMetadata, KVConnectorOutput, KVWorkerInfo
from tokenloom.core.request import Request


class SchedulerConnector:
    """In the EngineCore, beside the scheduler; sees requests and block ids, never tensors."""

    def on_add(self, request: Request) -> int | None:
        """A new request; returns a first output token already produced elsewhere (a remote prefill's)."""
        return None

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens past the local prefix-cache hit whose KV can be loaded instead of computed."""
        return 0

    def load_in_background(self, request: Request, others_computing: bool) -> bool:
        """Whether the request's external tokens load while other requests keep stepping (vLLM's
        WAITING_FOR_REMOTE_KVS: the request is scheduled once `update` hears its load completed) rather than
        within the step that computes it. `others_computing`: another request computes in this step."""
        return False

    def after_allocate(self, request: Request, num_local_tokens: int, num_external_tokens: int,
                       background: bool = False) -> None:
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

    def at_shutdown(self) -> KVConnectorMetadata | None:
        """A last step's instructions for a clean shutdown (the disk tier saves the cached blocks it lacks)."""
        return None

    def stats(self) -> dict:
        return {}


class WorkerConnector:
    """Beside the model runner; moves bytes. Per step, after vLLM's KVConnectorBase_V1: `start_load_kv` before
    the forward, then (only when `has_layer_work`) `wait_for_layer_load(i)` right before layer i touches its
    cache and `save_kv_layer(i)` right after layer i wrote it, `wait_for_save` after the forward, and
    `get_finished` for the report. Without layer work the forward runs untouched (CUDA graphs included)."""

    def info(self) -> KVWorkerInfo:
        raise NotImplementedError

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Begin this step's loads (they complete asynchronously) and whatever else precedes the forward."""

    def has_layer_work(self) -> bool:
        """Whether this step's forward must call the per-layer hooks."""
        return False

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer `layer` is about to read and write its cache: what it reads must be there, and what it
        overwrites must be saved, when this returns."""

    def save_kv_layer(self, layer: int) -> None:
        """Layer `layer` has written this step's KV into its cache."""

    def wait_for_save(self, meta: KVConnectorMetadata, requests: dict) -> None:
        """After the forward (`requests`: the runner's RequestState by key): the cache may be reused once
        this returns."""

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        """Transfers sent, background loads completed and loads failed since the last call. `idle`: the step
        computed nothing, so a connector with loads in flight may wait a little for one rather than spin."""
        return KVConnectorOutput()

    def close(self) -> None:
        """Stop serving and release sockets and files (pending writes are completed)."""
