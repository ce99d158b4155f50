"""The engine view's data: one JSON snapshot of what the engine is doing, for the web page.

Why not let the page scrape /metrics? Prometheus histograms only give bucketed, cumulative
latencies since start-up, and the text format is costly to parse every second in a
browser. Here the server keeps what the page needs, cheaply:

* raw TTFT, TPOT and end-to-end latencies of the last minute (fed by `ServerMetrics`'
  listeners, so they are the very values /metrics counts), from which exact percentiles
  are taken;
* a 1-per-second history (the last minute) of the engine's gauges and token rates, for
  the page's small charts; a sample is taken when a snapshot is asked for, at most once
  a second, so an idle server with no page open does no work;
* the last warnings and errors the server logged (failed or timed-out requests, engine
  faults), captured by a logging handler, so no error path needs to know about the page.
"""
from __future__ import annotations

import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import tokenloom
from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.core.stats import EngineStats
from tokenloom.engine.async_llm import AsyncLLM

WINDOW_S = 60.0
MAX_ERRORS = 20
RATE_SPAN_S = 5.0  # token rates and budget use are averaged over this many seconds


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles ({"p50": ..., ...}); None for an empty window."""
    if not values:
        return {f"p{q:g}": None for q in qs}
    ordered = sorted(values)
    return {f"p{q:g}": ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in qs}


def quantization(weights_file: str | None, kept_quantized: bool, dtype: str | None) -> str:
    """How the engine holds the weights: a GGUF file's type as its name tells it (llama.cpp names:
    ``*.Q4_1.gguf``), and whether the engine reported its blocks kept quantized for the native kernels
    or dequantized to `dtype` at load (the torch path, CUDA, or a type the kernels do not take)."""
    if not weights_file or not weights_file.lower().endswith(".gguf"):
        return "none"
    m = re.search(r"[.-]((?:I?Q\d\w*)|F16|F32|BF16)\.gguf$", weights_file, re.IGNORECASE)
    kind = f"GGUF {m.group(1).upper()}" if m else "GGUF"
    return f"{kind}, quantized on the native kernels" if kept_quantized else f"{kind}, dequantized to {dtype} at load"


class _RecentErrors(logging.Handler):
    """Keeps the last WARNING+ records of the tokenloom loggers (request failures, engine faults)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: deque[JsonObject] = deque(maxlen=MAX_ERRORS)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            message = str(record.msg)
        self.records.append({"time": record.created, "level": record.levelname, "logger": record.name,
                             "message": message[:500]})


@dataclass
class HistoryPoint:
    """One second of the page's charts."""

    t: float
    running: int
    waiting: int
    kv_cache_usage: float
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    budget_use: float | None = None  # tokens computed per step over the step's token budget


_RATE_COUNTERS = ("prompt_tokens", "generation_tokens", "steps", "batched_tokens")


class StatusTracker:
    """Collects the engine view's numbers for one server (one `AsyncLLM`)."""

    def __init__(self, engine: AsyncLLM, window_s: float = WINDOW_S) -> None:
        self.engine = engine
        self.window_s = window_s
        self.started = time.time()
        self.latencies: dict[str, deque[tuple[float, float]]] = {k: deque() for k in ("ttft", "tpot", "e2e")}
        self.history: deque[HistoryPoint] = deque()
        self._counters: deque[tuple[float, dict[str, int]]] = deque()  # (time, engine counters)
        self.errors = _RecentErrors()
        # More of the snapshot, by key, from the server's other parts (the batches' progress).
        self.sections: dict[str, Callable[[], JsonValue]] = {}
        logging.getLogger("tokenloom").addHandler(self.errors)
        if engine.metrics is not None:
            engine.metrics.listeners.append(self._on_metric)

    def close(self) -> None:
        logging.getLogger("tokenloom").removeHandler(self.errors)
        if self.engine.metrics is not None and self._on_metric in self.engine.metrics.listeners:
            self.engine.metrics.listeners.remove(self._on_metric)

    # ------------------------------------------------------------------ inputs

    def _on_metric(self, name: str, value: float) -> None:
        series = self.latencies.get(name)
        if series is not None:
            series.append((time.time(), value))

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for series in self.latencies.values():
            while series and series[0][0] < cutoff:
                series.popleft()
        while self.history and self.history[0].t < cutoff:
            self.history.popleft()

    # ------------------------------------------------------------------ outputs

    def header(self) -> JsonObject:
        """What does not change while the server runs: model, dtypes, KV cache, version."""
        e = self.engine
        info = e.info
        model_path = e.model_path or ""
        weights = os.path.basename(model_path) if model_path else None
        dtype = (info.dtype if info else None) or e.config.model.dtype
        return {
            "model": e.served_model_name,
            "model_path": model_path,
            "weights_file": weights,
            "quantization": quantization(weights, bool(info and info.weights_quantized), dtype),
            "weights_bytes": info.weights_bytes if info else None,
            "dtype": dtype,
            "kv_cache_dtype": info.kv_cache.dtype if info else None,
            "device": info.device if info else None,
            "kv_blocks": info.kv_cache.num_blocks if info else None,
            "block_size": info.kv_cache.block_size if info else None,
            "max_model_len": e.max_model_len,
            "max_num_seqs": e.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": e.config.scheduler.max_num_batched_tokens,
            "tensor_parallel_size": info.tensor_parallel_size if info else 1,
            "image_input": e.takes_images,
            "version": tokenloom.__version__,
            "started": self.started,
        }

    def _sample(self, now: float, stats: EngineStats) -> HistoryPoint:
        """One history point: the engine's gauges plus token rates over the last RATE_SPAN_S
        seconds (a 1-second difference of step counters is too jumpy to read: a step can
        take longer than a second on a loaded CPU)."""
        counters = {k: getattr(stats, k) for k in _RATE_COUNTERS}
        point = HistoryPoint(t=now, running=stats.num_running, waiting=stats.num_waiting,
                             kv_cache_usage=stats.kv_cache_usage)
        # The oldest sample within the span (the last one when the page was away longer).
        base = next(((t, c) for t, c in self._counters if now - t <= RATE_SPAN_S), None)
        if base is None and self._counters:
            base = self._counters[-1]
        if base is not None:
            t0, c0 = base
            dt = max(now - t0, 1e-6)
            # An engine restart resets its counters: a negative delta counts as zero.
            delta = {k: max(0, counters[k] - c0.get(k, 0)) for k in counters}
            point.prompt_tps = delta["prompt_tokens"] / dt
            point.generation_tps = delta["generation_tokens"] / dt
            budget = self.engine.config.scheduler.max_num_batched_tokens
            if delta["steps"] and budget:
                point.budget_use = delta["batched_tokens"] / (delta["steps"] * budget)
        self._counters.append((now, counters))
        while self._counters and now - self._counters[0][0] > RATE_SPAN_S + 2:
            self._counters.popleft()
        return point

    def requests(self, now: float) -> list[JsonValue]:
        """The open requests, oldest first: id, state, token counts, age."""
        return [{"id": s.request_id, "age": now - s.arrival, "prompt_tokens": s.num_prompt_tokens,
                 "output_tokens": s.generated, "seqs": s.num_seqs, "state": s.stage}
                for s in self.engine.open_requests()]

    def snapshot(self) -> JsonObject:
        """Everything the engine view shows, as JSON-ready data."""
        now = time.time()
        stats = self.engine.engine_stats
        if not self.history or now - self.history[-1].t >= 0.9:
            self.history.append(self._sample(now, stats))
        self._trim(now)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        latency: JsonObject = {name: {**percentiles([v for _, v in series]), "count": len(series)}
                               for name, series in self.latencies.items()}
        latest = self.history[-1]
        info = self.engine.info
        return {
            "time": now,
            "healthy": bool(self.engine.is_healthy),
            "header": self.header(),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total or (info.kv_cache.num_blocks if info else None),
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens_total": stats.prompt_tokens,
            "generation_tokens_total": stats.generation_tokens,
            "prompt_tps": latest.prompt_tps,
            "generation_tps": latest.generation_tps,
            "budget_use": latest.budget_use,
            "latency": latency,
            "history": [asdict(p) for p in self.history],
            "requests": self.requests(now),
            "errors": list(reversed(self.errors.records)),
            **{name: build() for name, build in self.sections.items()},
        }
