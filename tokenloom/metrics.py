"""Prometheus metrics of the server, prefix ``tokenloom:``, named as operators know them from vLLM.

One `ServerMetrics` per server, on its own registry (so tests and several servers in
one process never clash). The frontend feeds it:

* `observe_engine_stats(stats)` after each engine step / heartbeat: gauges for running
  and waiting requests and KV-cache usage, and the engine's cumulative counters
  (prefix cache queries/hits, preemptions) turned into counter increments;
* `observe_iteration(num_tokens)` once per engine step;
* `observe_first_token` / `observe_inter_token` while a request streams;
* `observe_finished(...)` once per request, with what was served to the client, so the
  token counters match the ``usage`` the responses reported.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# No `*_created` series next to every counter (vLLM does the same).
disable_created_metrics()

PREFIX = "tokenloom:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, cache_info: dict[str, Any] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.kv_cache_used_blocks = gauge("kv_cache_used_blocks",
                                          "KV-cache blocks held by requests (0 when the engine is idle).")
        self.engine_restarts = counter("engine_restarts", "Times the EngineCore process was restarted.")
        self.engine_healthy = gauge("engine_healthy", "1 while the engine process is alive and answering.")
        self._rejected = Counter(PREFIX + "request_rejected", "Requests refused before reaching the engine "
                                 "(queue_full, engine_unavailable).", labels + ["reason"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens served.")
        self._success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.request_success = {reason: self._success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Request latency, end to end.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                            _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time from first scheduled to first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time from first token to the last.", _REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _TOKEN_BUCKETS)
        self.cache_config_info = Gauge(PREFIX + "cache_config_info", "Information of the KV-cache config.",
                                       sorted((cache_info or {}).keys()), registry=r)
        if cache_info:
            self.cache_config_info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        else:
            self.cache_config_info.set(1)
        self._engine_counters: dict[str, float] = {}

    # -------------------------------------------------------------- engine side

    def observe_engine_stats(self, stats: dict[str, Any]) -> None:
        if not stats:
            return
        if "num_running" in stats:
            self.num_requests_running.set(stats["num_running"])
        if "num_waiting" in stats:
            self.num_requests_waiting.set(stats["num_waiting"])
        usage = stats.get("kv_cache_usage")
        if usage is not None:
            self.kv_cache_usage_perc.set(usage)
        if stats.get("kv_blocks_used") is not None:
            self.kv_cache_used_blocks.set(stats["kv_blocks_used"])
        for key, metric in (("prefix_cache_queries", self.prefix_cache_queries),
                            ("prefix_cache_hits", self.prefix_cache_hits),
                            ("num_preemptions", self.num_preemptions)):
            value = stats.get(key)
            if value is None:
                continue
            last = self._engine_counters.get(key, 0.0)
            if value > last:
                metric.inc(value - last)
            self._engine_counters[key] = max(last, float(value))

    def reset_engine_counters(self) -> None:
        """A new engine process counts from zero again."""
        self._engine_counters = {}

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def observe_iteration(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    # -------------------------------------------------------------- per request

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(max(0.0, seconds))

    def observe_finished(self, *, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                         e2e: float, queue: float | None = None, prefill: float | None = None,
                         decode: float | None = None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        reason = finish_reason if finish_reason in self.request_success else "error"
        self.request_success[reason].inc()
        self.e2e_request_latency.observe(max(0.0, e2e))
        for hist, value in ((self.request_queue_time, queue), (self.request_prefill_time, prefill),
                            (self.request_decode_time, decode)):
            if value is not None and value >= 0:
                hist.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
