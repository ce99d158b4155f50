"""KV blocks: reference counts, an LRU free list, and hash-chained full blocks for prefix caching."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """SHA-256 over (parent hash, tokens, salt): collisions cannot plausibly corrupt output."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode())
    return h.digest()


# Stands in a block table for a block freed behind a sliding window (vLLM's null block): attention never
# reads a position there, so any block id would do, but a real one could be registered in the prefix cache
# under a hash it no longer holds. Reserved (never handed out) when a pool is built with reserve_null.
NULL_BLOCK = 0


class BlockPool:
    """Hands out blocks. Freed blocks keep their cached content until they are reused.

    The free list is in eviction order: the least recently freed block goes first,
    and a request frees its tail blocks before its head ones.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.num_reserved = 0
        if reserve_null:
            del self.free[NULL_BLOCK]
            self.num_reserved = 1
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        self.on_evict: Callable[[int, bytes], None] | None = None  # a KV offload tier saves the block's content

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free) - self.num_reserved

    def usage(self) -> float:
        return self.num_used / (len(self.blocks) - self.num_reserved)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError(f"need {count} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(count):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on (cached or shared) blocks."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self.free[bid]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference on each block; pass them head first, tail blocks are evicted first."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[bid] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {bid} released more often than taken")

    def register(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use."""
        if self.num_used:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
