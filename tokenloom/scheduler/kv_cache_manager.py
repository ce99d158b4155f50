"""Per-request block bookkeeping on top of the BlockPool: prefix hits, growth, forks, freeing, and the
release of blocks behind a sliding window.

Windowed release: when every layer attends within the last W positions (`sliding_window`; Mistral), a
block whose positions all lie before the next query's window is never read again; it goes back to the
pool (keeping its prefix-cache hash, so a later prompt with the same prefix can still hit it) and the
request's table holds NULL_BLOCK in its place. A model with any full-attention layer (Gemma 3's global
ones) reads every block, so nothing is released: vLLM's hybrid manager keeps a table per layer group to
free the windowed layers' share; here the KV cache is one tensor per layer with one table for all, and
release is all-or-nothing per block.
"""
from __future__ import annotations

from tokenloom.core.request import Request
from tokenloom.scheduler.block_pool import NULL_BLOCK, BlockPool, hash_block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window  # set only when every layer attends within it
        self.pool = BlockPool(num_blocks, enable_prefix_caching, reserve_null=sliding_window is not None)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    def _extend_hashes(self, request: Request, upto_tokens: int) -> None:
        bs = self.block_size
        while (len(request.block_hashes) + 1) * bs <= upto_tokens:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            request.block_hashes.append(hash_block(parent, request.token_ids[i * bs:(i + 1) * bs],
                                                   request.block_salt(i * bs, (i + 1) * bs)))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Longest chain of cached blocks for this request; the last token is always left to compute."""
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return []
        self._extend_hashes(request, request.num_tokens - 1)
        hits = []
        for h in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def release_behind_window(self, request: Request) -> None:
        """Free the blocks the request's next query can no longer attend to (windowed models only). The
        released blocks form a prefix of its table; `request.num_released_blocks` counts them."""
        if self.sliding_window is None:
            return
        first_kept = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        first_kept = min(first_kept, len(request.block_ids))
        start = request.num_released_blocks
        if first_kept <= start:
            return
        self.pool.release(request.block_ids[start:first_kept])
        request.block_ids[start:first_kept] = [NULL_BLOCK] * (first_kept - start)
        request.num_released_blocks = first_kept
        request.resend_blocks = True  # the workers' table changes in place

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request room for num_new_tokens more; False (nothing allocated) if the pool is short.
        Blocks behind its window are freed first either way: the step never reads them."""
        self.release_behind_window(request)
        needed_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed_blocks = -(-needed_tokens // self.block_size) - len(request.block_ids) - len(cached_blocks)
        evictable_hits = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        if needed_blocks > self.pool.num_free - evictable_hits:
            return False
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            request.block_ids.extend(cached_blocks)
        if needed_blocks > 0:
            request.block_ids.extend(self.pool.allocate(needed_blocks))
        return True

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register blocks that just became full and computed, so later requests can reuse them.
        `num_computed_tokens`: how many of its tokens have their KV computed, when not all it counts do."""
        if not self.pool.enable_caching:
            return
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        full = min(computed, request.num_tokens) // self.block_size
        self._extend_hashes(request, full * self.block_size)
        for i in range(request.num_released_blocks, full):
            self.pool.register(request.block_ids[i], request.block_hashes[i])

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Share the parent's blocks with the child; copy the partial last block. Returns (src, dst) to copy."""
        self.pool.touch(child.block_ids[child.num_released_blocks:])
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        src = child.block_ids[-1]
        if self.pool.num_free < 1:
            self.pool.release(child.block_ids[child.num_released_blocks:])
            raise MemoryError("no free KV block to fork into")
        dst = self.pool.allocate(1)[0]
        self.pool.release([src])
        child.block_ids[-1] = dst
        child.block_hashes = child.block_hashes[: parent.num_computed_tokens // self.block_size]
        return src, dst

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids[request.num_released_blocks:])
        request.block_ids = []
        request.num_released_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()
