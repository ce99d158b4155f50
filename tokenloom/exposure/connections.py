"""How many connections a client may hold and for how long: what keeps idle and slow connections from
filling the server.

uvicorn has a keep-alive timeout (an idle connection between two requests is closed) but none for a
connection that never finishes its request head: a fresh connection that sends nothing, or a head sent
a byte at a time (slowloris), stays open for good, and nothing bounds how many of them one client
holds. `guarded_protocol` wraps uvicorn's HTTP protocol with

- a head timeout: a request head (request line and headers) not complete within ``--timeout-header``
  seconds of the connection's start or of the previous response's end closes the connection;
- a cap on open connections per client address (``--max-connections-per-client``; the router or a
  benchmark on one machine is one address, hence a generous default): one more is answered 429 and
  closed;
- a cap on all open connections (``--max-connections``), kept under the process's open-file limit:
  one more is answered 503 and closed.

`tokenloom serve` and `tokenloom router` both take these flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tokenloom.config import ConfigError, env_default

logger = logging.getLogger("tokenloom.server")

# A client sends its request head in one write, within milliseconds; nginx's client_header_timeout is 60 s,
# Apache's mod_reqtimeout 20-40 s. 10 s leaves a slow mobile link room and frees a slowloris slot 6x sooner.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's
# `tokenloom bench serve` opens one connection per prompt in flight (1,000 by default) from one address.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024
DEFAULT_MAX_CONNECTIONS = 4096
# Descriptors kept for everything else the process opens (model files, sockets to the engine, logs).
RESERVED_FILES = 256
REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or not self.keep_alive_timeout > 0:
            raise ConfigError("--timeout-header and --timeout-keep-alive must be > 0 seconds")
        if self.max_connections < 1 or self.max_connections_per_client < 1:
            raise ConfigError("--max-connections and --max-connections-per-client must be >= 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ConnectionLimits":
        return cls(header_timeout=args.timeout_header, keep_alive_timeout=args.timeout_keep_alive,
                   max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client)

    def uvicorn_options(self) -> dict[str, object]:
        """uvicorn.Config keyword arguments: the guarded protocol and the keep-alive timeout."""
        return {"http": guarded_protocol(self), "timeout_keep_alive": self.keep_alive_timeout}


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """The connection flags (each also TOKENLOOM_<NAME>), shared by `tokenloom serve` and `tokenloom router`."""
    g = parser.add_argument_group("connections")
    g.add_argument("--timeout-header", type=float, default=env_default("timeout_header", DEFAULT_HEADER_TIMEOUT, float),
                   help="close a connection whose request head is not complete this many seconds after it opened "
                        f"or after its previous response (slow or silent clients; default {DEFAULT_HEADER_TIMEOUT:g})")
    g.add_argument("--timeout-keep-alive", type=float,
                   default=env_default("timeout_keep_alive", DEFAULT_KEEP_ALIVE_TIMEOUT, float),
                   help="close a kept-alive connection idle this many seconds between requests (uvicorn's flag; "
                        f"default {DEFAULT_KEEP_ALIVE_TIMEOUT:g})")
    g.add_argument("--max-connections", type=int,
                   default=env_default("max_connections", DEFAULT_MAX_CONNECTIONS, int),
                   help="open connections in all; one more is answered 503 and closed (lowered to fit the "
                        f"open-file limit; default {DEFAULT_MAX_CONNECTIONS})")
    g.add_argument("--max-connections-per-client", type=int,
                   default=env_default("max_connections_per_client", DEFAULT_MAX_CONNECTIONS_PER_CLIENT, int),
                   help="open connections from one client address; one more is answered 429 and closed "
                        f"(default {DEFAULT_MAX_CONNECTIONS_PER_CLIENT})")


def fit_open_file_limit(wanted: int) -> int:
    """Raise the soft open-file limit toward the hard one so `wanted` connections fit; returns how many fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    fit = max(1, soft - RESERVED_FILES)
    logger.warning("the open-file limit (%d) holds %d connections, not --max-connections %d; raise `ulimit -n`",
                   soft, fit, wanted)
    return fit


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": code, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class _RefusalLog:
    """One warning per interval with the count since the last one: a flood does not flood the log."""

    def __init__(self) -> None:
        self.last = 0.0
        self.count = 0

    def note(self, what: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("%s (%d refused since the last such line)", what, self.count)
            self.last, self.count = now, 0


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (h11 or httptools, as uvicorn picks) with the head timeout and the caps.
    Each call makes a class of its own, with its own per-client counts."""
    max_connections = fit_open_file_limit(limits.max_connections)
    per_client: Counter[str] = Counter()
    refusals = _RefusalLog()
    too_many = _refusal(503, "Service Unavailable", "the server has too many open connections; retry later",
                        "too_many_connections")
    too_many_here = _refusal(429, "Too Many Requests", "too many open connections from this address; reuse one or "
                             "close some", "too_many_connections")

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _host: str | None = None
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else "unix"
            if len(self.connections) > max_connections:
                refusals.note(f"connection from {host} refused: {max_connections} open (--max-connections)")
                return self._refuse(too_many)
            if per_client[host] >= limits.max_connections_per_client:
                refusals.note(f"connection from {host} refused: {per_client[host]} open from there "
                              "(--max-connections-per-client)")
                return self._refuse(too_many_here)
            self._host = host
            per_client[host] += 1
            self._arm_head_timer()

        def _refuse(self, response: bytes) -> None:
            self.transport.write(response)
            self.transport.close()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timeout, self.cycle)

        def _head_timeout(self, cycle_when_armed: object) -> None:
            self._head_timer = None
            if self.cycle is cycle_when_armed and not self.transport.is_closing():  # no new request head since
                logger.debug("closing a connection from %s: no complete request head within %g s", self._host,
                             limits.header_timeout)
                self.transport.close()

        def on_response_complete(self) -> None:
            self._arm_head_timer()  # before: a pipelined request's head may be handled within the call
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._host is not None:
                per_client[self._host] -= 1
                if per_client[self._host] <= 0:
                    del per_client[self._host]
                self._host = None
            super().connection_lost(exc)

    return GuardedHTTPProtocol
