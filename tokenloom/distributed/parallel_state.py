"""The tensor-parallel group of this process, and the few collectives the model needs.

One group per process, set once by the worker (`init_tensor_parallel`) before the model is
built. Until then, and in the in-process (`uni`) executor, the group has size 1 and every
collective returns its input unchanged, so model code calls them unconditionally.

gloo is the CPU backend and NCCL the CUDA one. Collectives on gloo run on CPU tensors; the
gloo timeout is long because the control broadcast of an idle engine waits between steps
(a dead peer still fails at once: its socket closes; a hung one is caught by the engine's
step timeout).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# An idle engine sends no step for as long as nobody asks; the workers wait in a broadcast meanwhile.
IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    backend: str = "none"

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_GROUP = TensorParallelGroup()
_CONTROL_GROUP = None  # gloo group for the CPU-side control broadcast when the data backend is NCCL


def tp_group() -> TensorParallelGroup:
    return _GROUP


def init_tensor_parallel(rank: int, size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the group of `size` ranks that rendezvous at master_addr:master_port (rank 0 hosts the store)."""
    global _GROUP, _CONTROL_GROUP
    if size == 1:
        _GROUP = TensorParallelGroup()
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=size, timeout=IDLE_TIMEOUT)
    if backend == "nccl":
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _GROUP = TensorParallelGroup(rank, size, backend)


def destroy_tensor_parallel() -> None:
    global _GROUP, _CONTROL_GROUP
    if _GROUP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP, _CONTROL_GROUP = TensorParallelGroup(), None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place."""
    if _GROUP.size > 1:
        dist.all_reduce(t)
    return t


def all_reduce_min(value: int) -> int:
    if _GROUP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return int(t.item())


def gather_to_first(t: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `t` along the last dimension on rank 0; other ranks get None."""
    if _GROUP.size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(_GROUP.size)] if _GROUP.is_first else None
    dist.gather(t, parts, dst=0)
    return torch.cat(parts, dim=-1) if _GROUP.is_first else None


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0's `payload` on every rank (length first, then the bytes: two small collectives)."""
    if _GROUP.size == 1:
        return payload
    length = torch.tensor([len(payload) if _GROUP.is_first else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=_CONTROL_GROUP)
    if _GROUP.is_first:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=_CONTROL_GROUP)
    return payload if _GROUP.is_first else data.numpy().tobytes()


def gather_bytes_to_first(payload: bytes) -> list[bytes] | None:
    """Every rank's `payload`, in rank order, on rank 0; None on the others (lengths first, then the bytes
    padded to the longest: two small collectives)."""
    if _GROUP.size == 1:
        return [payload]
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(_GROUP.size)]
    dist.all_gather(lengths, length, group=_CONTROL_GROUP)
    longest = max(int(n.item()) for n in lengths)
    data = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(_GROUP.size)]
    dist.all_gather(parts, data, group=_CONTROL_GROUP)
    if not _GROUP.is_first:
        return None
    return [p[:int(n.item())].numpy().tobytes() for p, n in zip(parts, lengths)]


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `total` (which the caller checked divides)."""
    rank = _GROUP.rank if rank is None else rank
    size = _GROUP.size if size is None else size
    part = total // size
    return rank * part, part
