"""A process group between a trainer and the engine's workers, for sending new weights by broadcast.

Reinforcement-learning loops train in one process and generate in the engine, and move the weights between
them many times an hour. The trainer is rank 0 of a group of its own; the engine's tensor-parallel ranks
join it at `rank_offset + tp_rank` (SGLang's `init_weights_update_group`). The group stands apart from
the engine's tensor-parallel group (a store and a process group of its own: torch's default group is
the engine's, or absent), so it can come and go while the engine serves. gloo on CPU, NCCL on CUDA.

The trainer side is `WeightSender`: open it while the server handles `/init_weights_update_group`, then for
each tensor, broadcast it while the server handles `/update_weights_from_distributed` with its name, dtype
and shape. Every worker receives every whole tensor and shards it as it would a checkpoint's.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The trainer and the engine meet within this time, or the side that came first gives up.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)


class WeightSyncError(ValueError):
    """A weight-sync request the engine cannot carry out (its message becomes the 400's)."""


def dtype_named(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise WeightSyncError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def open_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> dist.ProcessGroup:
    """Rank `rank` of a `world_size` group whose rank 0 (the trainer) hosts the store at the address."""
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"backend must be gloo or nccl (got {backend!r})")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside a group of {world_size}")
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def receive(group: dist.ProcessGroup, dtype: torch.dtype, shape: list[int], device: torch.device) -> torch.Tensor:
    """One tensor broadcast by the trainer (rank 0)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    group.broadcast(tensor, 0).wait()
    return tensor


class WeightSender:
    """The trainer's end: rank 0 of the group, broadcasting tensors to every engine worker."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str = "gloo"):
        self.group = open_group(master_address, master_port, 0, world_size, backend)

    def send(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor.contiguous(), 0).wait()
