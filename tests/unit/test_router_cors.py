"""The router answers CORS itself, as `tokenloom serve` does: closed by default, opened by --allowed-origins,
and a worker's own CORS headers never reach the client through it. The worker here is a real HTTP server on a
socket that answers every request, preflights included, with ``Access-Control-Allow-Origin: *``."""
from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from starlette.testclient import TestClient

from tokenloom.exposure.cors import CorsSettings
from tokenloom.router.app import RouterSettings, build_router_app
from tokenloom.router.cli import add_router_args, settings_from_args


async def open_worker(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2"),
                            (b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"*")]})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture(scope="module")
def worker_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(open_worker, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def router(worker_url: str, cors: CorsSettings | None = None) -> TestClient:
    return TestClient(build_router_app(RouterSettings(worker_urls=[worker_url], policy="round_robin",
                                                      cors=cors or CorsSettings())))


def preflight(client: TestClient, origin: str):
    return client.options("/v1/models", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})


def cors_headers(response) -> list[str]:
    return [h for h in response.headers if h.lower().startswith("access-control-")]


def test_by_default_the_router_relays_no_cors_header(worker_url):
    with router(worker_url) as client:
        r = client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and cors_headers(r) == []
        assert cors_headers(preflight(client, "http://evil.example")) == []


def test_an_allowed_origin_gets_the_routers_answer_not_the_workers(worker_url):
    cors = CorsSettings(allowed_origins=["http://app.example"])
    with router(worker_url, cors) as client:
        r = preflight(client, "http://app.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = client.get("/v1/models", headers={"Origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = preflight(client, "http://evil.example")
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_the_router_takes_the_servers_cors_flags():
    args = add_router_args(argparse.ArgumentParser()).parse_args(
        ["--worker-urls", "http://w:1", "--allowed-origins", '["http://app.example"]', "--allow-credentials"])
    assert settings_from_args(args).cors == CorsSettings(allowed_origins=["http://app.example"],
                                                         allow_credentials=True)
