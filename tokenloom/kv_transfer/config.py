"""Typed configuration of KV transfer (vLLM's --kv-transfer-config, FastDeploy's --splitwise-role) and of
the KV offload tier (vLLM's --kv-offloading-backend / --kv-offloading-size, plus a directory)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenloom.config import ConfigError, parse_json_config

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)
LOAD_FAILURE_POLICIES = ("recompute", "fail")
TRANSPORTS = ("tcp", "ipc")
# FastDeploy's --splitwise-role names for vLLM's kv_role; "mixed" runs prefill and decode in one instance.
SPLITWISE_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": None}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer listens for pulls (another machine's decoder: its own IP)
    kv_port: int = 0  # 0: a free port (tcp); with ipc, part of the socket's file name
    kv_transport: str = "tcp"  # tcp | ipc (one machine: a Unix socket)
    kv_load_failure_policy: str = "recompute"  # a failed pull: recompute the prompt locally, or fail the request
    # Seconds a producer keeps a finished prefill's blocks for its decoder; then they are freed (vLLM's
    # abort-request timeout is 480 s for RDMA setups; a decoder here pulls within a step or two).
    kv_lease_s: float = 60.0
    # Seconds a consumer waits for one pull; past it the load has failed (and follows the policy).
    kv_transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check(self.kv_connector in KV_CONNECTORS,
               f"kv_connector must be one of {', '.join(KV_CONNECTORS)} (got {self.kv_connector!r})")
        _check(self.kv_role in KV_ROLES, f"kv_role must be one of {', '.join(KV_ROLES)} (got {self.kv_role!r})")
        _check(self.kv_transport in TRANSPORTS,
               f"kv_transport must be one of {', '.join(TRANSPORTS)} (got {self.kv_transport!r})")
        _check(self.kv_load_failure_policy in LOAD_FAILURE_POLICIES,
               f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)} "
               f"(got {self.kv_load_failure_policy!r})")
        _check(isinstance(self.kv_port, int) and 0 <= self.kv_port < 65536,
               f"kv_port must be in 0..65535 (got {self.kv_port!r})")
        _check(self.kv_lease_s > 0, f"kv_lease_s must be > 0 (got {self.kv_lease_s})")
        _check(self.kv_transfer_timeout_s > 0,
               f"kv_transfer_timeout_s must be > 0 (got {self.kv_transfer_timeout_s})")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value) -> "KVTransferConfig | None":
        """From a dict, a JSON string (the CLI flag), an instance or None."""
        return parse_json_config(cls, value, "kv_transfer_config")

    @classmethod
    def from_splitwise_role(cls, role: str) -> "KVTransferConfig | None":
        _check(role in SPLITWISE_ROLES,
               f"splitwise_role must be one of {', '.join(SPLITWISE_ROLES)} (got {role!r})")
        kv_role = SPLITWISE_ROLES[role]
        return None if kv_role is None else cls(kv_role=kv_role)


OFFLOADING_BACKENDS = ("native",)


@dataclass
class KVOffloadConfig:
    """Evicted prefix-cache blocks go to host memory, or to `path` (a directory) when it is set."""

    backend: str = "native"
    size_gib: float = 1.0  # bound on the tier: host bytes, or disk bytes under path
    path: str | None = None

    def __post_init__(self) -> None:
        _check(self.backend in OFFLOADING_BACKENDS,
               f"kv_offloading_backend must be one of {', '.join(OFFLOADING_BACKENDS)} (got {self.backend!r})")
        _check(self.size_gib > 0, f"kv_offloading_size must be > 0 GiB (got {self.size_gib})")
