"""Data parallel: each engine replica's health as /health reports it."""
from __future__ import annotations

from typing import NotRequired, TypedDict

from tokenloom.engine.dp_client import DPEngineClient


class ReplicaHealth(TypedDict):
    engine: int  # the replica's rank
    alive: bool  # serving (up and answered Ready; a restarting one is not)
    pid: int | None
    reason: NotRequired[str]  # why not alive: "restarting", or how it died


def replica_health(client: DPEngineClient) -> list[ReplicaHealth]:
    out: list[ReplicaHealth] = []
    for rank, r in enumerate(client.replicas):
        entry = ReplicaHealth(engine=rank, alive=client.is_serving(rank), pid=r.engine_pid)
        if not entry["alive"]:
            reason = "restarting" if r.is_alive else r.dead_reason
            if reason is not None:
                entry["reason"] = reason
        out.append(entry)
    return out
