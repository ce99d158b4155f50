"""Connection timeouts and caps (tokenloom/exposure/connections.py) on a real uvicorn server and raw sockets:
a silent connection and a head sent a byte at a time are closed at the head timeout, an idle kept-alive one at
the keep-alive timeout, a slow response is not cut, and the per-client and total caps answer 429 / 503."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from tokenloom.exposure.connections import ConnectionLimits

HEAD_TIMEOUT = 0.6
KEEP_ALIVE = 0.6
SLACK = 1.5  # seconds allowed past a timeout on a loaded machine
SLOW_RESPONSE_S = 1.2  # longer than the head timeout


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_RESPONSE_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Server:
    def __init__(self, limits: ConnectionLimits):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", **limits.uvicorn_options())
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=HEAD_TIMEOUT + KEEP_ALIVE + SLACK + 5)
        return s

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(**kw) -> Server:
        defaults = dict(header_timeout=HEAD_TIMEOUT, keep_alive_timeout=KEEP_ALIVE)
        servers.append(Server(ConnectionLimits(**{**defaults, **kw})))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (reads and drops what it sends first)."""
    t0 = time.monotonic()
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def get(sock: socket.socket, path: str = "/") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, f"closed before the response ended: {data!r}"
        data += chunk
    return data


def test_connections_that_send_nothing_are_closed_at_the_head_timeout(serve):
    server = serve()
    idle = [server.connect() for _ in range(30)]
    t0 = time.monotonic()
    for s in idle:
        closed_after(s)
    assert HEAD_TIMEOUT * 0.8 <= time.monotonic() - t0 < HEAD_TIMEOUT + SLACK


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_head_timeout(serve):
    server = serve()
    sock = server.connect()
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 1000
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for byte in head:
            sock.send(bytes([byte]))
            time.sleep(0.05)
            assert time.monotonic() - t0 < HEAD_TIMEOUT + SLACK, "still open past the head timeout"
    assert time.monotonic() - t0 >= HEAD_TIMEOUT * 0.8


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(serve):
    server = serve(header_timeout=30.0)
    sock = server.connect()
    assert get(sock).startswith(b"HTTP/1.1 200")
    assert closed_after(sock) < KEEP_ALIVE + SLACK


def test_a_second_request_on_a_kept_alive_connection_is_served(serve):
    server = serve()
    sock = server.connect()
    for _ in range(3):
        assert get(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEAD_TIMEOUT / 3)


def test_a_response_slower_than_the_head_timeout_is_not_cut(serve):
    server = serve()
    sock = server.connect()
    assert get(sock, "/slow").startswith(b"HTTP/1.1 200")


def _refusal(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_one_connection_over_the_per_client_cap_gets_429_and_is_closed(serve):
    server = serve(max_connections_per_client=5)
    held = [server.connect() for _ in range(5)]
    status, body = _refusal(server.connect())
    assert status == 429 and body["error"]["code"] == "too_many_connections"
    held.pop().close()
    time.sleep(0.2)
    assert get(server.connect()).startswith(b"HTTP/1.1 200")  # a slot freed is a slot again


def test_one_connection_over_the_total_cap_gets_503(serve):
    server = serve(max_connections=4)
    held = [server.connect() for _ in range(4)]  # noqa: F841 - held open
    status, body = _refusal(server.connect())
    assert status == 503 and body["error"]["code"] == "too_many_connections"


def test_the_server_answers_while_slow_clients_hold_connections(serve):
    server = serve(header_timeout=30.0)
    slow = [server.connect() for _ in range(30)]
    for s in slow:
        s.sendall(b"GET / HTTP/1.1\r\nHost")
    assert get(server.connect()).startswith(b"HTTP/1.1 200")
    for s in slow:
        s.close()
