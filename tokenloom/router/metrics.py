"""The router's own /metrics (prometheus-client, its own registry), labelled by worker URL."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenloom.router.workers import WorkerPool

disable_created_metrics()  # no `*_created` series beside every counter (as the server's /metrics)

PREFIX = "tokenloom_router_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(PREFIX + "requests", "Requests answered, by the worker that answered and status "
                                "(worker \"none\": answered by the router itself).", ["worker", "status"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests retried on another worker, by the worker that failed "
                               "before the response started.", ["worker"], registry=r)
        self.decisions = Counter(PREFIX + "routing_decisions", "Worker choices, by policy and reason (cache_aware: "
                                 "prefix, fresh or balance).", ["policy", "reason"], registry=r)
        self.first_byte = Histogram(PREFIX + "time_to_response_headers_seconds", "From the request's arrival to "
                                    "the worker's response headers (streamed: about the time to first token).",
                                    ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram(PREFIX + "request_duration_seconds", "From the request's arrival to the last byte "
                                  "passed on.", ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.healthy = Gauge(PREFIX + "worker_healthy", "1 while the worker is in rotation.", ["worker", "role"],
                             registry=r)
        self.inflight = Gauge(PREFIX + "worker_inflight_requests", "Requests open through this router.",
                              ["worker", "role"], registry=r)

    def render(self) -> bytes:
        for w in self.pool.workers:
            self.healthy.labels(w.url, w.role).set(1 if w.healthy else 0)
            self.inflight.labels(w.url, w.role).set(w.inflight)
        return generate_latest(self.registry)
