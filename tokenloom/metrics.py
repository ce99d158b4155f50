"""Prometheus metrics of the server, prefix ``tokenloom:``, named as operators know them from vLLM.

Names, types, the ``model_name`` label and the histogram buckets follow vLLM's, so that its Grafana
dashboards work unchanged once the prefix is ``vllm:`` (``--metrics-prefix vllm``, or
``TOKENLOOM_METRICS_PREFIX=vllm``). The deprecated ``gpu_prefix_cache_*`` counters are kept because
the production-stack dashboard still reads them.

One `ServerMetrics` per server, on its own registry (so tests and several servers in
one process never clash). The frontend feeds it:

* `observe_engine_stats(stats)` with the engine's latest stats, before each /metrics render: gauges for running
  and waiting requests and KV-cache usage, and the engine's cumulative counters
  (prefix cache queries/hits, preemptions) turned into counter increments;
* `observe_iteration(num_tokens)` once per engine step;
* `observe_first_token` / `observe_inter_token` while a request streams;
* `observe_finished(...)` once per request, with what was served to the client, so the
  token counters match the ``usage`` the responses reported.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenloom.core.stats import EngineStats

# No `*_created` series next to every counter (vLLM does the same).
disable_created_metrics()

PREFIX = "tokenloom:"


def default_prefix() -> str:
    """``tokenloom:`` unless TOKENLOOM_METRICS_PREFIX names another (``vllm`` or ``vllm:``)."""
    name = os.environ.get("TOKENLOOM_METRICS_PREFIX", "").strip() or PREFIX
    return name if name.endswith(":") else name + ":"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_DEFAULT_MAX_MODEL_LEN = 8192
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, cache_info: dict[str, str | int | bool] | None = None,
                 registry: CollectorRegistry | None = None, prefix: str | None = None,
                 max_model_len: int | None = None, engines: int = 1) -> None:
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            # process_* (CPU seconds, resident memory, open fds, start time) and python_* as every
            # prometheus-client process exposes them; the http_* families are added by the app.
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        self.model_name = model_name
        self.prefix = prefix = prefix if prefix is not None else default_prefix()
        labels = ["model_name"]
        r = self.registry
        length_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)

        def gauge(name, doc):
            return Gauge(prefix + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(prefix + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        # Engine-level series: one per engine replica. With data parallel (engines > 1) they carry vLLM's
        # `engine` label; with one engine they keep the label set single-engine dashboards expect.
        self.engines = max(1, engines)
        engine_labels = labels + (["engine"] if self.engines > 1 else [])
        self._families: dict[str, Gauge | Counter] = {}

        def family(kind, attr, name, doc):
            self._families[attr] = kind(prefix + name, doc, engine_labels, registry=r)

        family(Gauge, "num_requests_running", "num_requests_running", "Requests in the running batch.")
        family(Gauge, "num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled.")
        family(Gauge, "kv_cache_usage_perc", "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        family(Counter, "prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        family(Counter, "prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        family(Counter, "gpu_prefix_cache_queries", "gpu_prefix_cache_queries",
               "Deprecated name of prefix_cache_queries (kept for dashboards).")
        family(Counter, "gpu_prefix_cache_hits", "gpu_prefix_cache_hits",
               "Deprecated name of prefix_cache_hits (kept for dashboards).")
        family(Counter, "num_preemptions", "num_preemptions", "Preemptions by the scheduler.")
        family(Counter, "spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative verify spans (one per "
               "sequence and step that carried drafts).")
        family(Counter, "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified.")
        family(Counter, "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
               "Draft tokens accepted.")
        family(Gauge, "kv_cache_used_blocks", "kv_cache_used_blocks",
               "KV-cache blocks held by requests (0 when the engine is idle).")
        family(Counter, "engine_restarts", "engine_restarts", "Times the EngineCore process was restarted.")
        family(Gauge, "engine_healthy", "engine_healthy", "1 while the engine process is alive and answering.")
        self._spec_per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     engine_labels + ["position"], registry=r)
        for engine in range(self.engines):  # every replica's series exists from the start
            for attr in self._families:
                self._child(attr, engine)
        # The first engine's series under their historical attribute names.
        for attr in self._families:
            setattr(self, attr, self._child(attr, 0))
        self._rejected = Counter(prefix + "request_rejected", "Requests refused before reaching the engine "
                                 "(queue_full, engine_unavailable).", labels + ["reason"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens served.")
        self._success = Counter(prefix + "request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.request_success = {reason: self._success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.",
                                             _PER_TOKEN_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per request: decode time over its output tokens after the "
            "first.", _PER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Request latency, end to end.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                            _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time from first scheduled to first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time from first token to the last.", _REQUEST_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "Time from first scheduled to finished (prefill + decode).",
                                                _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               length_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request (all its sequences).",
                                                   length_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Per finished request: the longest of its sequences, in tokens.",
            length_buckets)
        self.request_params_n = histogram("request_params_n", "The n parameter of the requests.", _N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "The max_tokens parameter of the requests.", length_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _TOKEN_BUCKETS)
        self.cache_config_info = Gauge(prefix + "cache_config_info", "Information of the KV-cache config.",
                                       sorted((cache_info or {}).keys()), registry=r)
        if cache_info:
            self.cache_config_info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        else:
            self.cache_config_info.set(1)
        self._engine_counters: dict[tuple[int, str], float] = {}
        # Callables (name, value) told of each raw latency sample ("ttft", "tpot", "e2e"), for the
        # web page's last-minute percentiles (histograms only keep buckets).
        self.listeners: list[Callable[[str, float], None]] = []

    # -------------------------------------------------------------- engine side

    def _child(self, attr: str, engine: int = 0):
        labels = (self.model_name, str(engine)) if self.engines > 1 else (self.model_name,)
        return self._families[attr].labels(*labels)

    def engine_restarts_of(self, engine: int):
        return self._child("engine_restarts", engine)

    def engine_healthy_of(self, engine: int):
        return self._child("engine_healthy", engine)

    def observe_engine_stats(self, stats: EngineStats, engine: int = 0) -> None:
        """One engine's (replica's) stats after a step or heartbeat."""
        child = lambda attr: self._child(attr, engine)  # noqa: E731
        child("num_requests_running").set(stats.num_running)
        child("num_requests_waiting").set(stats.num_waiting)
        child("kv_cache_usage_perc").set(stats.kv_cache_usage)
        child("kv_cache_used_blocks").set(stats.kv_blocks_used)
        for key, attrs in (("prefix_cache_queries", ("prefix_cache_queries", "gpu_prefix_cache_queries")),
                           ("prefix_cache_hits", ("prefix_cache_hits", "gpu_prefix_cache_hits")),
                           ("num_preemptions", ("num_preemptions",)),
                           ("spec_num_drafts", ("spec_decode_num_drafts",)),
                           ("spec_num_draft_tokens", ("spec_decode_num_draft_tokens",)),
                           ("spec_num_accepted_tokens", ("spec_decode_num_accepted_tokens",))):
            value = getattr(stats, key)
            if value is None:
                continue
            last = self._engine_counters.get((engine, key), 0.0)
            if value > last:
                for attr in attrs:
                    child(attr).inc(value - last)
            self._engine_counters[(engine, key)] = max(last, float(value))
        for pos, value in enumerate(stats.spec_num_accepted_tokens_per_pos or ()):
            key = (engine, f"spec_per_pos_{pos}")
            last = self._engine_counters.get(key, 0.0)
            if value > last:
                labels = (self.model_name, str(engine)) if self.engines > 1 else (self.model_name,)
                self._spec_per_pos.labels(*labels, str(pos)).inc(value - last)
            self._engine_counters[key] = max(last, float(value))

    def observe_engine_stopped(self, engine: int = 0) -> None:
        """A dead engine (replica) runs and queues nothing."""
        self._child("num_requests_running", engine).set(0)
        self._child("num_requests_waiting", engine).set(0)

    def reset_engine_counters(self, engine: int | None = None) -> None:
        """A new engine process (one replica, or all with None) counts from zero again."""
        self._engine_counters = {k: v for k, v in self._engine_counters.items()
                                 if engine is not None and k[0] != engine}

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def observe_iteration(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    # -------------------------------------------------------------- per request

    def observe_request_params(self, *, n: int, max_tokens: int | None) -> None:
        """Once per request, as it arrives."""
        self.request_params_n.observe(n)
        if max_tokens:
            self.request_params_max_tokens.observe(max_tokens)

    def _tell(self, name: str, value: float) -> None:
        for listener in self.listeners:
            listener(name, value)

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))
        self._tell("ttft", max(0.0, seconds))

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(max(0.0, seconds))

    def observe_finished(self, *, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                         e2e: float, queue: float | None = None, prefill: float | None = None,
                         decode: float | None = None, max_generation_tokens: int | None = None) -> None:
        """`max_generation_tokens`: the longest sequence of an n > 1 request (default: generation_tokens)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_max_num_generation_tokens.observe(
            generation_tokens if max_generation_tokens is None else max_generation_tokens)
        reason = finish_reason if finish_reason in self.request_success else "error"
        self.request_success[reason].inc()
        self.e2e_request_latency.observe(max(0.0, e2e))
        self._tell("e2e", max(0.0, e2e))
        for hist, value in ((self.request_queue_time, queue), (self.request_prefill_time, prefill),
                            (self.request_decode_time, decode)):
            if value is not None and value >= 0:
                hist.observe(value)
        if prefill is not None and decode is not None and prefill >= 0 and decode >= 0:
            self.request_inference_time.observe(prefill + decode)
        longest = generation_tokens if max_generation_tokens is None else max_generation_tokens
        if decode is not None and decode >= 0 and longest > 1:
            self.request_time_per_output_token.observe(decode / (longest - 1))
            self._tell("tpot", decode / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
