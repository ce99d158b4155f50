"""The worker's last start-up phase: one small prefill and one decode through the runner's own backend, so
the first request does not pay for lazy initialisation, then the CUDA graphs' capture when the runner's
forward path has them."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from tokenloom.heap_trim import release_free_heap
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.worker.runner import ModelRunner


def warm_up_runner(runner: ModelRunner, progress: bool) -> float:
    """Warm the runner up and capture its graphs; returns the warm-up decode's seconds (admission's first
    guess of the engine's speed, before any request is measured)."""
    seconds = warm_up_forward(runner.model, runner.kv_caches, runner.block_size, runner.device, runner.attention,
                              progress)
    runner.forward.capture(progress)
    release_free_heap()  # what loading and the warm-up freed (5 MiB on the embedded model): heap_trim.py
    return seconds


@torch.inference_mode()
def warm_up_forward(model, kv_caches, block_size: int, device, attention: AttentionBackend, progress: bool) -> float:
    """One small prefill and one decode through the backend's own metadata (oneDNN primitives, the thread pool,
    SDPA's first call). They write blocks 0 and 1, zeroed again after. Returns the decode's seconds."""
    if getattr(model, "is_encoder", False):  # no KV cache, no head: one whole short sequence
        model(torch.zeros(8, dtype=torch.long, device=device), torch.arange(8, device=device))
        return 0.0
    with tqdm(total=2, desc="Warming up", unit="pass", disable=not progress, leave=False) as bar:
        n = min(8, block_size)
        blocks = [0, 1]
        slots = torch.arange(n, device=device)
        meta = attention.build_metadata([ScheduledSpan(0, 0, n, blocks)], slots)
        model.compute_logits(model(torch.zeros(n, dtype=torch.long, device=device), slots, kv_caches, meta)[-1:])
        bar.update(1)
        position = torch.tensor([n], device=device)
        meta = attention.build_metadata([ScheduledSpan(0, n, 1, blocks)], position)
        seconds = float("inf")
        for _ in range(2):  # the first call pays for lazy set-up; the faster of two is the step's time
            start = time.perf_counter()
            model.compute_logits(model(torch.zeros(1, dtype=torch.long, device=device), position, kv_caches, meta))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = min(seconds, time.perf_counter() - start)
        bar.update(1)
    for cache in kv_caches:
        cache[:, :2].zero_()
    return seconds
