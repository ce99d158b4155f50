"""The router's workers: their URLs, health and in-flight counts, and the health-check loop.

A worker is taken out after `failure_threshold` failed checks in a row (a refused connection of
a proxied request counts as one), and brought back after `success_threshold` good ones. A check
is ``GET URL/health``: tokenloom answers 503 while its engine is dead or restarting, 200 otherwise
(also while a data-parallel replica is down: the server still serves).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger("tokenloom.router")


@dataclass
class Worker:
    url: str
    role: str = "mixed"  # mixed | prefill | decode (PD mode)
    healthy: bool = True  # assumed until a check says otherwise, so the router serves at once
    inflight: int = 0  # requests this router has open on it (its load for least_load / cache_aware)
    failures: int = 0  # consecutive failed checks
    successes: int = 0  # consecutive good checks


@dataclass
class HealthSettings:
    endpoint: str = "/health"
    interval: float = 10.0  # seconds between checks (SGLang's router: 60; shorter finds a dead worker sooner)
    timeout: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2


class WorkerPool:
    def __init__(self, workers: list[Worker], health: HealthSettings) -> None:
        self.workers = workers
        self.health = health

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def healthy(self, role: str = "mixed") -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.healthy]

    def report(self, worker: Worker, ok: bool) -> None:
        """One health observation (a check, or a proxied request that could not connect)."""
        if ok:
            worker.failures = 0
            worker.successes += 1
            if not worker.healthy and worker.successes >= self.health.success_threshold:
                worker.healthy = True
                logger.warning("worker %s is healthy again; routing to it", worker.url)
        else:
            worker.successes = 0
            worker.failures += 1
            if worker.healthy and worker.failures >= self.health.failure_threshold:
                worker.healthy = False
                logger.warning("worker %s failed %d health checks in a row; taken out", worker.url, worker.failures)

    async def check(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            r = await client.get(worker.url + self.health.endpoint, timeout=self.health.timeout)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.report(worker, ok)

    async def run_checks(self, client: httpx.AsyncClient) -> None:
        """Check every worker each interval, until cancelled."""
        while True:
            await asyncio.gather(*(self.check(client, w) for w in self.workers))
            await asyncio.sleep(self.health.interval)
