"""Where offloaded blocks live: host memory, or one file per block in a directory (kept across restarts).

A block is stored as ``[layers, 2, block_size, kv_heads, head_dim]``. A file starts with a small header
(model identity, name, layout) that is checked on every read, so a block is only ever read back into the
same model and layout it came from, whatever happened to the directory in between.
"""
from __future__ import annotations

import os
import struct

import msgspec
import torch

SUFFIX = ".kv"
MAX_HEADER = 4096


class BlockHeader(msgspec.Struct):
    identity: str
    name: str
    layout: str


class HostStore:
    """Pinned host memory on CUDA (copies back overlap nothing yet, but are DMA-able); plain memory on CPU."""

    def __init__(self, identity: str, layout: str):
        self.blocks: dict[str, torch.Tensor] = {}

    def put(self, name: str, block: torch.Tensor) -> None:
        """Keeps `block` itself: the worker hands over a host buffer of its own, filled for this name."""
        self.blocks[name] = block

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        block = self.blocks.get(name)
        return block if block is not None and block.shape == shape and block.dtype == dtype else None

    def delete(self, name: str) -> None:
        self.blocks.pop(name, None)


class DiskStore:
    def __init__(self, identity: str, layout: str, folder: str):
        self.identity = identity
        self.layout = layout
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name + SUFFIX)

    def put(self, name: str, block: torch.Tensor) -> None:
        header = msgspec.json.encode(BlockHeader(self.identity, name, self.layout))
        tmp = self.path(name) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<I", len(header)) + header)
            f.write(memoryview(block.contiguous().cpu().view(torch.uint8).numpy()))
        os.replace(tmp, self.path(name))  # readers never see half a block

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        try:
            with open(self.path(name), "rb") as f:
                (n,) = struct.unpack("<I", f.read(4))
                if n > MAX_HEADER:
                    return None
                header = msgspec.json.decode(f.read(n), type=BlockHeader)
                data = f.read()
        except (OSError, struct.error, msgspec.DecodeError):
            return None
        expected = torch.Size(shape).numel() * dtype.itemsize
        if (header.identity, header.name, header.layout) != (self.identity, name, self.layout) or len(data) != expected:
            return None
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)

    def delete(self, name: str) -> None:
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass


def list_stored(folder: str) -> list[str]:
    """Names in a disk tier's folder, least recently written first (the order to evict them in)."""
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(SUFFIX)]
    except FileNotFoundError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime_ns)
    return [e.name[:-len(SUFFIX)] for e in entries]


def tier_folder(path: str, identity: str) -> str:
    """One subfolder per model identity: another model's blocks are not even listed."""
    return os.path.join(path, identity[:32])
