"""The router's HTTP app: its own /health, /metrics and /workers; every other path is proxied.

CORS is the router's own (the same flags and default as `tokenloom serve`: closed): preflights are
answered here and the workers' CORS headers are dropped from what is relayed (proxy.py).

With `pd` set, completions (``/v1/completions``, ``/v1/chat/completions``) run on a prefill/decode
pair (router/pd.py), sent with the pair's shared secret (the servers take kv_transfer_params from no one
else), and other paths go to a decode worker without it.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from tokenloom.exposure.cors import CorsSettings, install_cors
from tokenloom.kv_transfer.trust import SECRET_HEADER
from tokenloom.router.metrics import RouterMetrics
from tokenloom.router.policy import make_policy
from tokenloom.router.proxy import PD_PATHS, Proxy, error, parse_json, request_headers
from tokenloom.router.workers import HealthSettings, Worker, WorkerPool

# Request bodies above this get 413 (the same default as `tokenloom serve --max-request-body-bytes`).
DEFAULT_MAX_PAYLOAD = 16 * 2 ** 20


@dataclass
class RouterSettings:
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 20  # chunks of CHUNK_CHARS remembered per worker
    health: HealthSettings = field(default_factory=HealthSettings)
    max_retries: int = 2
    request_timeout: float = 1800.0  # seconds without a byte from the worker (a long non-streamed answer)
    max_payload_size: int = DEFAULT_MAX_PAYLOAD
    pd: bool = False
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    cors: CorsSettings = field(default_factory=CorsSettings)
    kv_secret: str | None = None  # PD: the pair's kv_secret, sent with every completion (kv_transfer/trust.py)

    def workers(self) -> list[Worker]:
        strip = lambda url: url.rstrip("/")  # noqa: E731
        if self.pd:
            return ([Worker(strip(u), role="prefill") for u in self.prefill_urls]
                    + [Worker(strip(u), role="decode") for u in self.decode_urls])
        return [Worker(strip(u)) for u in self.worker_urls]


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_router_app(settings: RouterSettings) -> FastAPI:
    pool = WorkerPool(settings.workers(), settings.health)
    metrics = RouterMetrics(pool)
    policy_args = dict(cache_threshold=settings.cache_threshold, balance_abs_threshold=settings.balance_abs_threshold,
                       balance_rel_threshold=settings.balance_rel_threshold, max_tree_size=settings.max_tree_size)
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # trust_env=False: a proxy set in the environment must not sit between the router and its workers.
        client = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout, connect=5.0), trust_env=False,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        state["proxy"] = Proxy(pool, make_policy(settings.policy, **policy_args), metrics, client,
                               settings.max_retries, decode_policy=make_policy(settings.policy, **policy_args))
        checks = asyncio.create_task(pool.run_checks(client), name="router-health-checks")
        try:
            yield
        finally:
            checks.cancel()
            await client.aclose()

    app = FastAPI(title="tokenloom router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool = pool
    app.state.metrics = metrics
    install_cors(app, settings.cors)

    def serving() -> bool:
        if settings.pd:
            return bool(pool.healthy("prefill")) and bool(pool.healthy("decode"))
        return bool(pool.healthy("mixed"))

    def worker_list() -> list[dict]:
        return [{"url": w.url, "role": w.role, "healthy": w.healthy, "inflight": w.inflight} for w in pool.workers]

    @app.get("/health")
    async def health():
        ok = serving()
        return JSONResponse({"status": "ok" if ok else "no_healthy_worker", "workers": worker_list()},
                            status_code=200 if ok else 503)

    @app.get("/workers")
    async def workers():
        return {"policy": settings.policy, "pd": settings.pd, "workers": worker_list()}

    @app.get("/metrics")
    async def router_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def proxy(path: str, request: Request):
        body = await read_body(request, settings.max_payload_size)
        if body is None:
            metrics.requests.labels("none", "413").inc()
            return error(413, f"request body larger than {settings.max_payload_size} bytes", "payload_too_large")
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = request_headers(request.headers)
        parsed = parse_json(body)
        handler: Proxy = state["proxy"]
        if settings.pd:
            if request.method == "POST" and request.url.path in PD_PATHS and isinstance(parsed, dict):
                if settings.kv_secret:
                    headers[SECRET_HEADER] = settings.kv_secret
                return await handler.forward_pd(request.url.path, headers, parsed)
            return await handler.forward(request.method, target, headers, body, parsed, role="decode")
        return await handler.forward(request.method, target, headers, body, parsed)

    return app

