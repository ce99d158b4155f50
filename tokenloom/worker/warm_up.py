"""The worker's last start-up phase: the smallest passes that leave nothing lazy for the first request, and
admission's first guess of the engine's speed; then the CUDA graphs' capture when the forward path has them.

The passes run along the path a step takes (the native decoder stack where the runner has one, else the
layer-by-layer forward): a 2-token prefill, which every weight, kernel and the thread pool meet first, then
two decodes, the faster of which is the decode step's time. A longer prefill touches nothing more: on the
1B Q4_K_M with 2 threads the 8-token prefill the warm-up ran before took 116 ms of a 0.25 s warm-up (80 ms
when run again: the first pass is mostly the mapped weights' page faults), a decode 57 ms.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from tokenloom.heap_trim import release_free_heap
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.worker.runner import ModelRunner

# Tokens of the first pass: more than one, so that the multi-token kernels (prefill attention, the matmuls
# over several rows) run once before a request needs them.
PREFILL_TOKENS = 2

# (input ids, positions, attention metadata) -> hidden states, along the runner's forward path.
Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


def warm_up_runner(runner: ModelRunner, progress: bool) -> float:
    """Warm the runner up and capture its graphs; returns the warm-up decode's seconds (admission's first
    guess of the engine's speed, before any request is measured)."""
    seconds = warm_up_forward(runner.model, runner.kv_caches, runner.block_size, runner.device, runner.attention,
                              progress, step_forward(runner))
    runner.forward.capture(progress)
    release_free_heap()  # what loading and the warm-up freed (5 MiB on the embedded model): heap_trim.py
    return seconds


def step_forward(runner: ModelRunner) -> Forward:
    """The runner's forward for a plain step (no LoRA rows, no images, no connector hooks): its native decoder
    stack where it has one, else the layer-by-layer forward (CUDA graphs are captured, not warmed)."""
    stack, model, caches = runner.forward.native_stack, runner.model, runner.kv_caches
    if stack is not None and stack.can_run():
        return lambda ids, positions, meta: stack.run(ids, positions, caches, meta)
    return lambda ids, positions, meta: model(ids, positions, caches, meta)


@torch.inference_mode()
def warm_up_forward(model, kv_caches, block_size: int, device, attention: AttentionBackend, progress: bool,
                    forward: Forward | None = None) -> float:
    """A `PREFILL_TOKENS` prefill and two decodes through the backend's own metadata and `forward` (default the
    layer-by-layer one). They write blocks 0 and 1, zeroed again after. Returns the faster decode's seconds."""
    if getattr(model, "is_encoder", False):  # no KV cache, no head: one whole short sequence
        model(torch.zeros(8, dtype=torch.long, device=device), torch.arange(8, device=device))
        return 0.0
    if forward is None:
        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
            return model(ids, positions, kv_caches, meta)
    n = min(PREFILL_TOKENS, block_size)
    blocks = [0, 1]
    with tqdm(total=3, desc="Warming up", unit="pass", disable=not progress, leave=False) as bar:
        slots = torch.arange(n, device=device)
        meta = attention.build_metadata([ScheduledSpan(0, 0, n, blocks)], slots)
        model.compute_logits(forward(torch.zeros(n, dtype=torch.long, device=device), slots, meta)[-1:])
        bar.update(1)
        position = torch.tensor([n], device=device)
        meta = attention.build_metadata([ScheduledSpan(0, n, 1, blocks)], position)
        seconds = float("inf")
        for _ in range(2):  # the first decode may still pay for lazy set-up; the faster is the step's time
            start = time.perf_counter()
            model.compute_logits(forward(torch.zeros(1, dtype=torch.long, device=device), position, meta))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = min(seconds, time.perf_counter() - start)
            bar.update(1)
    for cache in kv_caches:
        cache[:, :2].zero_()
    return seconds
