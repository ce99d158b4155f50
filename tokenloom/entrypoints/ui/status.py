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
from typing import Any

import tokenloom

WINDOW_S = 60.0
MAX_ERRORS = 20
RATE_SPAN_S = 5.0  # token rates and budget use are averaged over this many seconds


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles ({"p50": ..., ...}); None for an empty window."""
    if not values:
        return {f"p{q:g}": None for q in qs}
    ordered = sorted(values)
    return {f"p{q:g}": ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in qs}


def quantization(weights_file: str | None) -> str:
    """The weights' quantization as the file name tells it (llama.cpp names: ``*.Q4_1.gguf``);
    tokenloom dequantizes GGUF weights at load, so it says so."""
    if not weights_file or not weights_file.lower().endswith(".gguf"):
        return "none"
    m = re.search(r"[.-]((?:I?Q\d\w*)|F16|F32|BF16)\.gguf$", weights_file, re.IGNORECASE)
    return f"GGUF {m.group(1).upper() if m else ''}, dequantized at load".replace("GGUF ,", "GGUF,")


class _RecentErrors(logging.Handler):
    """Keeps the last WARNING+ records of the tokenloom loggers (request failures, engine faults)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: deque[dict[str, Any]] = deque(maxlen=MAX_ERRORS)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            message = str(record.msg)
        self.records.append({"time": record.created, "level": record.levelname, "logger": record.name,
                             "message": message[:500]})


class StatusTracker:
    """Collects the engine view's numbers for one server (one `AsyncLLM`)."""

    def __init__(self, engine: Any, window_s: float = WINDOW_S) -> None:
        self.engine = engine
        self.window_s = window_s
        self.started = time.time()
        self.latencies: dict[str, deque[tuple[float, float]]] = {k: deque() for k in ("ttft", "tpot", "e2e")}
        self.history: deque[dict[str, Any]] = deque()
        self._counters: deque[tuple[float, dict[str, Any]]] = deque()  # (time, engine counters)
        self.errors = _RecentErrors()
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
        while self.history and self.history[0]["t"] < cutoff:
            self.history.popleft()

    # ------------------------------------------------------------------ outputs

    def header(self) -> dict[str, Any]:
        """What does not change while the server runs: model, dtypes, KV cache, version."""
        e = self.engine
        info = e.info
        model_path = getattr(e, "model_path", None) or ""
        weights = os.path.basename(model_path) if model_path else None
        return {
            "model": e.served_model_name,
            "model_path": model_path,
            "weights_file": weights,
            "quantization": quantization(weights),
            "dtype": info.get("dtype") or e.config.model.dtype,
            "kv_cache_dtype": info.get("kv_cache_dtype"),
            "device": info.get("device"),
            "kv_blocks": info.get("num_blocks"),
            "block_size": info.get("block_size"),
            "max_model_len": e.max_model_len,
            "max_num_seqs": e.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": e.config.scheduler.max_num_batched_tokens,
            "tensor_parallel_size": info.get("tensor_parallel_size", 1),
            "version": tokenloom.__version__,
            "started": self.started,
        }

    def _sample(self, now: float, stats: dict[str, Any]) -> dict[str, Any]:
        """One history point: the engine's gauges plus token rates over the last RATE_SPAN_S
        seconds (a 1-second difference of step counters is too jumpy to read: a step can
        take longer than a second on a loaded CPU)."""
        counters = {k: stats.get(k, 0) or 0 for k in ("prompt_tokens", "generation_tokens", "steps",
                                                      "batched_tokens")}
        point: dict[str, Any] = {
            "t": now, "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0), "prompt_tps": 0.0, "generation_tps": 0.0,
            "budget_use": None,
        }
        # The oldest sample within the span (the last one when the page was away longer).
        base = next(((t, c) for t, c in self._counters if now - t <= RATE_SPAN_S), None)
        if base is None and self._counters:
            base = self._counters[-1]
        if base is not None:
            t0, c0 = base
            dt = max(now - t0, 1e-6)
            # An engine restart resets its counters: a negative delta counts as zero.
            delta = {k: max(0, counters[k] - c0.get(k, 0)) for k in counters}
            point["prompt_tps"] = delta["prompt_tokens"] / dt
            point["generation_tps"] = delta["generation_tokens"] / dt
            budget = self.engine.config.scheduler.max_num_batched_tokens
            if delta["steps"] and budget:
                point["budget_use"] = delta["batched_tokens"] / (delta["steps"] * budget)
        self._counters.append((now, counters))
        while self._counters and now - self._counters[0][0] > RATE_SPAN_S + 2:
            self._counters.popleft()
        return point

    def snapshot(self) -> dict[str, Any]:
        """Everything the engine view shows, as JSON-ready data."""
        now = time.time()
        stats = self.engine.engine_stats
        if not self.history or now - self.history[-1]["t"] >= 0.9:
            self.history.append(self._sample(now, stats))
        self._trim(now)
        queries = stats.get("prefix_cache_queries") or 0
        hits = stats.get("prefix_cache_hits") or 0
        latency = {name: {**percentiles([v for _, v in series]), "count": len(series)}
                   for name, series in self.latencies.items()}
        latest = self.history[-1]
        return {
            "time": now,
            "healthy": bool(self.engine.is_healthy),
            "header": self.header(),
            "running": stats.get("num_running", 0),
            "waiting": stats.get("num_waiting", 0),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
            "kv_blocks_used": stats.get("kv_blocks_used", 0),
            "kv_blocks_total": stats.get("kv_blocks_total", self.engine.info.get("num_blocks")),
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "num_preemptions": stats.get("num_preemptions", 0),
            "prompt_tokens_total": stats.get("prompt_tokens", 0),
            "generation_tokens_total": stats.get("generation_tokens", 0),
            "prompt_tps": latest["prompt_tps"],
            "generation_tps": latest["generation_tps"],
            "budget_use": latest["budget_use"],
            "latency": latency,
            "history": list(self.history),
            "requests": self.engine.inflight_requests(),
            "errors": list(reversed(self.errors.records)),
        }
