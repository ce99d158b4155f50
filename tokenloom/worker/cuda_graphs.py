"""CUDA graphs for decode-only steps: one captured forward per batch size on a ladder.

A small model's decode step on a GPU is launch-bound: a few hundred kernels of microseconds each, with
the CPU issuing them one by one. A graph replays the whole forward with one launch. Steps are padded up
to the nearest captured size; padding rows read and write a scratch KV block that no request owns, so
they cannot disturb real sequences. Only the FlashInfer backend captures: its decode kernel reads the
page lists from fixed buffers that `plan` refills before each replay (the torch backend's decode groups
depend on the step's lengths, so it stays eager). `--enforce-eager` turns graphs off.

Inputs go through pinned host buffers with non-blocking copies, so preparing a step does not wait for
the GPU. The logits are computed outside the graph, on the real rows only.
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from tokenloom.model.layers.attention_backend import ScheduledSpan
from tokenloom.model.layers.attention_flashinfer import WORKSPACE_BYTES, FlashInferMetadata, paged_kv_layout

logger = logging.getLogger("tokenloom.engine")


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes to capture: the given ones up to max_num_seqs, or 1, 2, 4 and multiples of 8 (as vLLM
    does: small batches exactly, larger ones padded by at most 7 rows), always ending at max_num_seqs."""
    if sizes:
        return sorted({s for s in sizes if 1 <= s <= max_num_seqs})
    ladder = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return ladder + [max_num_seqs]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` rows; None when the step is larger than all of them."""
    return next((s for s in sizes if s >= batch), None)


def pad_spans(spans: list, size: int, scratch_block: int) -> list:
    """`spans` plus padding rows, each one token at position 0 of the scratch block."""
    first = sum(s.num_tokens for s in spans)
    return list(spans) + [ScheduledSpan(first + i, 0, 1, [scratch_block]) for i in range(size - len(spans))]


class _GraphWrappers:
    """What FlashInferAttention reads from `meta.backend` during a replay."""

    def __init__(self, decode):
        self.decode = decode
        self.prefill = None


class DecodeGraphs:
    """Captured decode forwards of one model over its KV caches, keyed by padded batch size."""

    def __init__(self, model, kv_caches: list[torch.Tensor], scratch_block: int, sizes: list[int],
                 max_blocks_per_seq: int):
        import flashinfer  # lazy: optional CUDA dependency
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_block = scratch_block
        self.sizes = sizes
        cache = kv_caches[0]
        self.device, self.block_size = cache.device, cache.shape[2]
        largest = sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.long, device=dev)
        self.slots = torch.full((largest,), scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.host = torch.zeros(3, largest, dtype=torch.long, pin_memory=True)  # ids, positions, slots
        self.indptr = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(largest * max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(largest, dtype=torch.int32, device=dev)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.wrappers = {
            b: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self.indptr[:b + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:b]) for b in sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.heads: tuple[int, int, int] | None = None

    @torch.inference_mode()
    def capture(self, heads: tuple[int, int, int], progress: bool = True) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        self.heads = heads
        pool = None
        for b in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph",
                      disable=not progress, leave=False):
            meta = self._plan(pad_spans([], b, self.scratch_block), b)
            run = lambda: self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)  # noqa: E731
            run()  # warm-up outside the graph: lazy initialisation, autotuning
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = run()
            pool = graph.pool()
            self.graphs[b] = graph
        logger.info("captured CUDA graphs for decode batch sizes %s", ", ".join(map(str, self.sizes)))

    def _plan(self, spans: list, size: int) -> FlashInferMetadata:
        num_heads, num_kv_heads, head_dim = self.heads
        layout = paged_kv_layout(spans, self.block_size)
        dtype = self.kv_caches[0].dtype
        self.wrappers[size].plan(layout.kv_indptr, layout.kv_indices.to(self.device), layout.last_page_len,
                                 num_heads, num_kv_heads, head_dim, self.block_size, q_data_type=dtype,
                                 kv_data_type=dtype, sm_scale=head_dim ** -0.5)
        return FlashInferMetadata(self.slots[:size], size, layout, None, _GraphWrappers(self.wrappers[size]),
                                  planned=True)

    def can_run(self, spans: list) -> bool:
        return bool(spans) and all(s.num_tokens == 1 for s in spans) and len(spans) <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], spans: list) -> torch.Tensor:
        """Hidden states of a decode-only step's rows, by replaying the graph of the padded size."""
        n = len(spans)
        size = padded_size(n, self.sizes)
        host = self.host
        host[0, :n] = torch.tensor(input_ids)
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor(slots)
        host[0, n:size] = 0
        host[1, n:size] = 0
        host[2, n:size] = self.scratch_block * self.block_size
        self.input_ids[:size].copy_(host[0, :size], non_blocking=True)
        self.positions[:size].copy_(host[1, :size], non_blocking=True)
        self.slots[:size].copy_(host[2, :size], non_blocking=True)
        self._plan(pad_spans(spans, size, self.scratch_block), size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
