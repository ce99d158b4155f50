"""What the router exposes: CORS answered by itself, as `tokenloom serve` does (closed by default, opened by
--allowed-origins; a worker's own CORS headers never reach the client through it), and in PD mode the pair's
shared secret sent with each completion (and required to start). The workers here are real HTTP servers on
sockets: one answers every request, preflights included, with ``Access-Control-Allow-Origin: *``; a PD pair
answers as tokenloom's do, taking kv_transfer_params only with the secret."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.testclient import TestClient

from tokenloom.config import ConfigError
from tokenloom.exposure.cors import CorsSettings
from tokenloom.kv_transfer.trust import SECRET_HEADER
from tokenloom.router.app import RouterSettings, build_router_app
from tokenloom.router.cli import add_router_args, settings_from_args


async def open_worker(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2"),
                            (b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"*")]})
    await send({"type": "http.response.body", "body": b"{}"})


class Upstream:
    """An ASGI app served by uvicorn on a socket of its own, in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def worker_url():
    upstream = Upstream(open_worker)
    yield upstream.url
    upstream.stop()


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


# ---------------------------------------------------------------- PD: the shared secret

SECRET = "0123456789abcdef0123"
TRANSFER = {"do_remote_prefill": True, "remote_address": "tcp://127.0.0.1:5600", "remote_transfer_id": "t1",
            "remote_num_tokens": 3, "first_token_id": 9}


async def _body(receive) -> dict:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return json.loads(b"".join(chunks) or b"{}")


def pd_worker(role: str):
    """Answers as a tokenloom server of `role` does: kv_transfer_params only with the secret, else 400."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = await _body(receive) if scope["method"] == "POST" else {}
        secret = dict(scope["headers"]).get(SECRET_HEADER.encode(), b"").decode()
        if body.get("kv_transfer_params") and secret != SECRET:
            status, answer = 400, {"error": {"code": "untrusted_kv_transfer"}}
        elif role == "prefill" and body.get("kv_transfer_params"):
            status, answer = 200, {"kv_transfer_params": TRANSFER}
        else:
            status, answer = 200, {"role": role, "kv_transfer_params": body.get("kv_transfer_params")}
        payload = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
    return app


@pytest.fixture(scope="module")
def pd_pair():
    pair = [Upstream(pd_worker("prefill")), Upstream(pd_worker("decode"))]
    yield pair[0].url, pair[1].url
    for upstream in pair:
        upstream.stop()


def pd_router(pd_pair, kv_secret: str | None) -> TestClient:
    return TestClient(build_router_app(RouterSettings(pd=True, prefill_urls=[pd_pair[0]], decode_urls=[pd_pair[1]],
                                                      policy="round_robin", kv_secret=kv_secret)))


def test_in_pd_mode_the_router_sends_the_pairs_secret_with_a_completion(pd_pair):
    with pd_router(pd_pair, SECRET) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json() == {"role": "decode", "kv_transfer_params": TRANSFER}


def test_a_router_without_the_secret_is_refused_by_the_pair(pd_pair):
    with pd_router(pd_pair, None) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_kv_transfer"


def test_the_router_lends_its_secret_to_no_other_request(pd_pair):
    """A client's own kv_transfer_params on a path the router does not run as PD reach the worker without it."""
    with pd_router(pd_pair, SECRET) as client:
        r = client.post("/v1/embeddings", json={"input": "hi", "kv_transfer_params": TRANSFER})
        assert r.status_code == 400


def test_pd_mode_needs_the_secret_to_start(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_KV_SECRET", raising=False)
    parser = add_router_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError, match="--kv-secret"):
        settings_from_args(parser.parse_args(["--pd", "--prefill", "http://p:1", "--decode", "http://d:1"]))
    args = parser.parse_args(["--pd", "--prefill", "http://p:1", "--decode", "http://d:1", "--kv-secret", SECRET])
    assert settings_from_args(args).kv_secret == SECRET
