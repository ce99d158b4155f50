"""Where offloaded blocks live: host memory, or one file per block in a directory (kept across restarts).

A block is stored as ``[layers, 2, block_size, kv_heads, head_dim]``. A file starts with a small header
(model identity, name, layout, the payload's length and CRC-32) that is checked on every read, so a block is
only ever read back into the same model and layout it came from, and only as it was written, whatever
happened to the directory in between: a truncated, corrupted or foreign file is logged, removed, and its
tokens recomputed (the read returns None and the request's load fails; see offload_worker.py).
"""
from __future__ import annotations

import logging
import os
import re
import struct
import zlib

import msgspec
import torch

logger = logging.getLogger("tokenloom.kv_transfer")

SUFFIX = ".kv"
MAX_HEADER = 4096
BLOCK_NAME = re.compile(r"[0-9a-f]{40}")  # offload_scheduler.name(): 40 hex digits of a sha256


class BlockHeader(msgspec.Struct):
    identity: str
    name: str
    layout: str
    # zlib's CRC-32 of the payload: it catches torn writes and flipped bits (not a forger, who could rewrite
    # the header as well). 0.7 ms per 737 KB block measured (about 1 GB/s; sha256 3.3 ms, blake2b 6 ms).
    size: int
    crc32: int


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
        payload = memoryview(block.contiguous().cpu().view(torch.uint8).numpy())
        header = msgspec.json.encode(BlockHeader(self.identity, name, self.layout, payload.nbytes,
                                                 zlib.crc32(payload)))
        tmp = self.path(name) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<I", len(header)) + header)
            f.write(payload)
        os.replace(tmp, self.path(name))  # readers never see half a block

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """The block, or None when its file is missing or fails a check (logged; a damaged file is removed)."""
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<I", f.read(4))
                if n > MAX_HEADER:
                    return self._bad(path, f"an unreadable header (said to be {n} bytes)")
                header = msgspec.json.decode(f.read(n), type=BlockHeader)
                data = f.read()
        except FileNotFoundError:
            logger.warning("offloaded KV block %s is missing; its tokens are recomputed", path)
            return None
        except (OSError, struct.error, msgspec.DecodeError) as e:
            return self._bad(path, f"an unreadable header ({e})")
        expected = torch.Size(shape).numel() * dtype.itemsize
        if (header.identity, header.name, header.layout) != (self.identity, name, self.layout):
            return self._bad(path, "another model's, block's or layout's header")
        if len(data) != expected or header.size != expected:
            return self._bad(path, f"{len(data)} bytes of payload, expected {expected} (truncated?)")
        if zlib.crc32(data) != header.crc32:
            return self._bad(path, "a checksum mismatch (corrupted)")
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)

    def _bad(self, path: str, why: str) -> None:
        logger.warning("offloaded KV block %s has %s: not read, its tokens are recomputed and the file removed",
                       path, why)
        try:
            os.remove(path)
        except OSError:
            pass
        return None

    def delete(self, name: str) -> None:
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass


def list_stored(folder: str) -> list[str]:
    """Block names in a disk tier's folder, least recently written first (the order to evict them in); other
    files, whatever their suffix, are left alone."""
    try:
        entries = [e for e in os.scandir(folder)
                   if e.name.endswith(SUFFIX) and BLOCK_NAME.fullmatch(e.name[:-len(SUFFIX)])]
    except FileNotFoundError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime_ns)
    return [e.name[:-len(SUFFIX)] for e in entries]


def tier_folder(path: str, identity: str) -> str:
    """One subfolder per model identity: another model's blocks are not even listed."""
    return os.path.join(path, identity[:32])
