"""KV blocks as bytes: consecutive runs of a layer's cache are contiguous, so they leave as views, not copies.

The KV cache of a layer is ``[2, num_blocks, block_size, kv_heads, head_dim]`` (keys, values); a run of
consecutive block ids in one half is one contiguous slice.
"""
from __future__ import annotations

import hashlib
import warnings

import torch


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs as (first id, length): [4, 5, 6, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def layer_views(cache: torch.Tensor, runs: list[tuple[int, int]]) -> list[memoryview]:
    """One buffer per (half, run) of one layer's cache, in that order: views on CPU (one copy each on CUDA)."""
    out = []
    for half in cache:
        for first, n in runs:
            t = half[first:first + n]
            if t.device.type != "cpu":
                t = t.to("cpu")
            out.append(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B"))
    return out


def half_block_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes of one block in one half (keys or values) of one layer."""
    cache = kv_caches[0]
    return cache[0, 0].numel() * cache.element_size()


def write_layer(cache: torch.Tensor, runs: list[int], buffers, block_ids: list[int]) -> str | None:
    """Copy one layer's buffers laid out as `layer_views` (run lengths `runs`) into `block_ids`; an error
    string if they do not fit (every size is checked before anything is written)."""
    halves = cache.shape[0]
    if len(buffers) != halves * len(runs) or sum(runs) != len(block_ids):
        return (f"got {len(buffers)} buffers for {sum(runs)} blocks, expected {halves * len(runs)} "
                f"for {len(block_ids)}")
    unit = cache[0, 0].numel() * cache.element_size()
    for i, buf in enumerate(buffers):
        if memoryview(buf).nbytes != runs[i % len(runs)] * unit:
            return f"buffer {i} has {memoryview(buf).nbytes} bytes, expected {runs[i % len(runs)] * unit}"
    i = 0
    for half in cache:
        cursor = 0
        for n in runs:
            with warnings.catch_warnings():  # zmq frames are read-only; we only read them
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(buffers[i], dtype=torch.uint8)
            src = src.view(half.dtype).view(n, *half.shape[1:])
            dst = torch.tensor(block_ids[cursor:cursor + n], device=cache.device)
            half.index_copy_(0, dst, src.to(cache.device))
            cursor += n
            i += 1
    return None


def layout(kv_caches: list[torch.Tensor]) -> str:
    """The cache's dtype and shape without the block count: two sides exchange blocks only if these match."""
    cache = kv_caches[0]
    dims = "x".join(str(d) for d in (len(kv_caches), cache.shape[0], *cache.shape[2:]))
    return f"{str(cache.dtype).removeprefix('torch.')}:{dims}"


def model_identity(model: torch.nn.Module, kv_caches: list[torch.Tensor], tp_rank: int, tp_size: int) -> str:
    """A digest of the weights' fingerprint and the KV layout: blocks saved under one identity are never read
    under another (a different model, dtype, block size or shard). The fingerprint hashes the first 4,096
    values of the first and last weight tensors (not prepacked), enough to tell models apart at a negligible cost."""
    h = hashlib.sha256(b"tokenloom-kv-v1")
    h.update(f"{layout(kv_caches)}|tp{tp_rank}/{tp_size}".encode())
    params = [p for p in model.parameters() if not p.is_mkldnn]  # prepacked oneDNN weights cannot be read
    h.update(str(sum(p.numel() for p in params)).encode())
    for p in (params[0], params[-1]):
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()
