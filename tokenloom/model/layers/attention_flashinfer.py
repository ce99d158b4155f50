"""FlashInfer attention on CUDA: paged decode and prefill kernels that read the block table directly.

tokenloom's cache layout is FlashInfer's NHD paged layout already: layer cache [2, blocks, block_size,
kv_heads, head_dim], so `cache[0]` and `cache[1]` are the K and V page pools and nothing is converted.
A step is planned once (page lists as CSR: indptr, indices, last-page length; see `paged_kv_layout`) and
every layer runs the planned kernels: one batched decode call for the one-token rows, one batched prefill
call for the chunks (speculative verify spans included; FlashInfer's causal mask is aligned to the end of
each sequence's context, which is what a chunk appended to cached tokens needs).

FlashInfer computes in float16/bfloat16; `supports()` says when it applies, and the `auto` backend choice
falls back to the torch backend (SDPA) otherwise or when `flashinfer` does not import.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.config import ConfigError
from tokenloom.model.layers.attention_backend import AttentionBackend

# FlashInfer's float workspace for split-KV partial results; 128 MiB is what its own examples and vLLM use.
WORKSPACE_BYTES = 128 * 2 ** 20


@dataclass
class PagedLayout:
    """A batch's pages in FlashInfer's CSR form (int32, on the host; `plan` copies what it needs)."""

    qo_indptr: torch.Tensor  # [batch + 1]: rows of sequence i are qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [batch + 1]: pages of sequence i are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [total pages]
    last_page_len: torch.Tensor  # [batch]: valid tokens in each sequence's last page, 1..block_size


def paged_kv_layout(spans, block_size: int) -> PagedLayout:
    """The CSR page lists of `spans` (ScheduledSpan: start, num_tokens, block_ids) after this step's tokens
    are written: each sequence attends over its first `start + num_tokens` cached tokens."""
    qo, kv, indices, last = [0], [0], [], []
    for s in spans:
        context = s.start + s.num_tokens
        pages = -(-context // block_size)
        indices.extend(s.block_ids[:pages])
        qo.append(qo[-1] + s.num_tokens)
        kv.append(len(indices))
        last.append(context - (pages - 1) * block_size)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return PagedLayout(as_int(qo), as_int(kv), as_int(indices), as_int(last))


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401  # lazy: optional CUDA dependency, probed
    except Exception:  # ImportError, or a CUDA/toolkit mismatch raised at import
        return False
    return torch.cuda.is_available()


def supports(device: torch.device, kv_dtype: torch.dtype) -> bool:
    return device.type == "cuda" and kv_dtype in (torch.float16, torch.bfloat16) and flashinfer_available()


@dataclass
class FlashInferMetadata:
    """A step's page lists and the wrappers that will run them. Planning waits for the first layer, which
    knows the per-rank head counts (layers build their attention before the runner's backend exists)."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_layout: PagedLayout | None
    prefill_layout: PagedLayout | None
    backend: "FlashInferBackend"
    planned: bool = False

    def plan(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.backend.plan(self, num_heads, num_kv_heads, head_dim, scale)
        self.planned = True


class FlashInferAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, q, k, v, kv_cache: torch.Tensor, meta: FlashInferMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D]. Returns [T, H*D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat = (-1, self.num_kv_heads, self.head_dim)
        k_cache.view(flat).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(flat).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        q = q.to(k_cache.dtype)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if not meta.planned:
            meta.plan(self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        d = meta.num_decodes
        if meta.decode_layout is not None:
            meta.backend.decode.run(q[:d], (k_cache, v_cache), out=out[:d])
        if meta.prefill_layout is not None:
            meta.backend.prefill.run(q[d:], (k_cache, v_cache), out=out[d:])
        return out.view(q.shape[0], -1)


class FlashInferBackend(AttentionBackend):
    """Chosen as `flashinfer`; plans each step once, for every layer."""

    name = "flashinfer"

    def __init__(self):
        try:
            import flashinfer  # lazy: optional CUDA dependency
        except Exception as e:
            raise ConfigError(f"attention backend 'flashinfer' needs the flashinfer-python package ({e})") from e
        self._flashinfer = flashinfer
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return 2, num_blocks, block_size, num_kv_heads, head_dim

    def bind(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cuda" or kv_cache.dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention backend 'flashinfer' needs a float16/bfloat16 KV cache on CUDA "
                              f"(got {kv_cache.dtype} on {kv_cache.device})")
        self.kv_cache = kv_cache
        fi, dev = self._flashinfer, kv_cache.device
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=True)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD")

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale=None, sliding_window=None):
        if sliding_window is not None:
            raise ConfigError("the flashinfer attention backend does not apply sliding windows yet "
                              "(use --attention-backend torch)")
        return FlashInferAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5 if scale is None else scale)

    def build_metadata(self, spans, slot_mapping: torch.Tensor) -> FlashInferMetadata:
        """`spans` list decodes (one token) first, as the runner orders them."""
        bs = self.kv_cache.shape[2]
        num_decodes = sum(1 for s in spans if s.num_tokens == 1)
        decodes, chunks = spans[:num_decodes], spans[num_decodes:]
        return FlashInferMetadata(slot_mapping, num_decodes, paged_kv_layout(decodes, bs) if decodes else None,
                                  paged_kv_layout(chunks, bs) if chunks else None, self)

    def plan(self, meta: FlashInferMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
             scale: float) -> None:
        bs, dtype, dev = self.kv_cache.shape[2], self.kv_cache.dtype, self.kv_cache.device
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        if meta.decode_layout is not None:
            d = meta.decode_layout
            self.decode.plan(d.kv_indptr, d.kv_indices.to(dev), d.last_page_len, num_heads, num_kv_heads,
                             head_dim, bs, **common)
        if meta.prefill_layout is not None:
            p = meta.prefill_layout
            self.prefill.plan(p.qo_indptr, p.kv_indptr, p.kv_indices.to(dev), p.last_page_len, num_heads,
                              num_kv_heads, head_dim, bs, causal=True, **common)
