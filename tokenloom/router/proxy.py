"""Forwarding one request to a worker: choose, send, retry while nothing has started, pass through.

The response (status, headers, body bytes) goes to the client unchanged and as it comes: the body
is relayed chunk by chunk from ``aiter_raw()``, so SSE events reach the client when the worker
writes them and compressed bodies stay compressed. A request is retried on another worker only
while the client has received nothing: the worker refused the connection, closed it before its
response headers, or answered 502/503/504 (overloaded, shutting down, engine restarting). Once the
headers are passed on, a worker failing mid-body ends the client's response with the same broken
connection it would have seen talking to the worker directly. A request that timed out is not
retried: the worker may still be running it.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping

import httpx
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenloom.core.json_types import JsonValue
from tokenloom.router import pd
from tokenloom.router.metrics import RouterMetrics
from tokenloom.router.policy import RoutingPolicy
from tokenloom.router.workers import Worker, WorkerPool

logger = logging.getLogger("tokenloom.router")

# Not forwarded in either direction (RFC 9110 7.6.1 connection-specific fields), plus host and
# content-length, which the client library sets for the new request.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
# CORS is the router's to answer (exposure/cors.py): a worker's own CORS headers are not relayed.
CORS_PREFIX = "access-control-"
RETRY_STATUSES = {502, 503, 504}
# The worker could not have started the request: nothing reached the client, so another may run it.
NOT_STARTED_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                      httpx.WriteError, httpx.PoolTimeout)
PD_PATHS = ("/v1/completions", "/v1/chat/completions")


def error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "param": None, "code": code}},
                        status_code=status)


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


class Proxy:
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, metrics: RouterMetrics, client: httpx.AsyncClient,
                 max_retries: int, decode_policy: RoutingPolicy | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.decode_policy = decode_policy or policy
        self.metrics = metrics
        self.client = client
        self.max_retries = max_retries

    def _choose(self, policy: RoutingPolicy, role: str, tried: set[str], body: JsonValue) -> Worker | None:
        candidates = [w for w in self.pool.healthy(role) if w.url not in tried]
        if not candidates:
            return None
        worker, reason = policy.choose(candidates, body)
        self.metrics.decisions.labels(policy.name, reason).inc()
        return worker

    def _no_worker(self, role: str) -> Response:
        self.metrics.requests.labels("none", "503").inc()
        return error(503, f"no healthy {role} worker is available", "no_worker")

    async def forward(self, method: str, path: str, headers: dict[str, str], body: bytes, parsed: JsonValue,
                      role: str = "mixed") -> Response:
        """Send to a worker of `role` chosen by the policy; retry on another one while nothing has started.
        (PD mode sends what is not a completion, e.g. /v1/models, to a decode worker.)"""
        arrival = time.monotonic()
        tried: set[str] = set()
        policy = self.decode_policy if role == "decode" else self.policy
        for attempt in range(self.max_retries + 1):
            worker = self._choose(policy, role, tried, parsed)
            if worker is None:
                break
            tried.add(worker.url)
            worker.inflight += 1
            try:
                resp = await self.client.send(self.client.build_request(method, worker.url + path, headers=headers,
                                                                        content=body), stream=True)
            except NOT_STARTED_ERRORS as e:
                worker.inflight -= 1
                self.pool.report(worker, ok=False)
                logger.warning("worker %s failed before responding (%s: %s); trying another", worker.url,
                               type(e).__name__, e)
                self.metrics.retries.labels(worker.url).inc()
                continue
            except httpx.TimeoutException:
                worker.inflight -= 1
                self.metrics.requests.labels(worker.url, "504").inc()
                return error(504, f"worker {worker.url} did not answer in time", "upstream_timeout")
            if resp.status_code in RETRY_STATUSES and attempt < self.max_retries and self._has_other(role, tried):
                await resp.aclose()
                worker.inflight -= 1
                self.metrics.retries.labels(worker.url).inc()
                logger.info("worker %s answered %d; trying another", worker.url, resp.status_code)
                continue
            return self._pass_through(resp, worker, arrival)
        if tried:
            self.metrics.requests.labels("none", "502").inc()
            return error(502, f"no worker could take the request (tried {len(tried)})", "bad_gateway")
        return self._no_worker(role)

    def _has_other(self, role: str, tried: set[str]) -> bool:
        return any(w.url not in tried for w in self.pool.healthy(role))

    async def forward_pd(self, path: str, headers: dict[str, str], parsed: JsonValue) -> Response:
        """A completion on a prefill/decode pair (pd.pd_request); retried on another pair while the
        prefill instance could not be reached."""
        arrival = time.monotonic()
        tried: set[str] = set()
        for _ in range(self.max_retries + 1):
            prefill = self._choose(self.policy, "prefill", tried, parsed)
            decode = self._choose(self.decode_policy, "decode", set(), parsed)
            if prefill is None or decode is None:
                return self._no_worker("prefill" if prefill is None else "decode")
            tried.add(prefill.url)
            prefill.inflight += 1
            decode.inflight += 1
            try:
                resp = await pd.pd_request(self.client, path, parsed, prefill.url, decode.url, headers=headers)
            except pd.PrefillFailed as e:
                decode.inflight -= 1
                self.metrics.requests.labels(prefill.url, str(e.status)).inc()
                return Response(e.body, status_code=e.status, media_type="application/json")
            except NOT_STARTED_ERRORS as e:
                decode.inflight -= 1
                self.pool.report(prefill, ok=False)
                self.metrics.retries.labels(prefill.url).inc()
                logger.warning("PD pair %s -> %s failed before responding (%s); trying another", prefill.url,
                               decode.url, type(e).__name__)
                continue
            except httpx.TimeoutException:
                decode.inflight -= 1
                self.metrics.requests.labels(prefill.url, "504").inc()
                return error(504, "the prefill or decode instance did not answer in time", "upstream_timeout")
            finally:
                prefill.inflight -= 1
            return self._pass_through(resp, decode, arrival)
        self.metrics.requests.labels("none", "502").inc()
        return error(502, f"no prefill worker could take the request (tried {len(tried)})", "bad_gateway")

    def _pass_through(self, resp: httpx.Response, worker: Worker, arrival: float) -> Response:
        self.metrics.first_byte.labels(worker.url).observe(time.monotonic() - arrival)
        done = False

        async def finish() -> None:
            nonlocal done
            if done:
                return
            done = True
            worker.inflight -= 1
            self.metrics.requests.labels(worker.url, str(resp.status_code)).inc()
            self.metrics.duration.labels(worker.url).observe(time.monotonic() - arrival)
            await resp.aclose()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                logger.warning("worker %s failed mid-response (%s); the client's response ends broken",
                               worker.url, type(e).__name__)
                raise
            finally:
                await finish()

        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in HOP_BY_HOP - {"content-length"} and not k.lower().startswith(CORS_PREFIX)}
        return StreamingResponse(relay(), status_code=resp.status_code, headers=headers,
                                 background=BackgroundTask(finish))


def parse_json(body: bytes) -> JsonValue:
    """The request's JSON (for the routing policy); None if it is not JSON (the worker will say so)."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None
