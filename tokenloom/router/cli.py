"""`tokenloom router`: an HTTP proxy in front of several OpenAI-compatible servers.

Flag names follow SGLang's router (``--worker-urls``, ``--policy``, ``--cache-threshold``,
``--balance-abs-threshold``, ``--balance-rel-threshold``, ``--health-*``, ``--max-payload-size``,
``--retry-max-retries``, ``--pd-disaggregation --prefill URL --decode URL``); ``--pd`` is a short alias.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

from tokenloom.config import ConfigError, env_default
from tokenloom.exposure.connections import ConnectionLimits, add_connection_args
from tokenloom.exposure.cors import CorsSettings, add_cors_args
from tokenloom.router.app import DEFAULT_MAX_PAYLOAD, RouterSettings, build_router_app
from tokenloom.router.policy import POLICIES
from tokenloom.router.workers import HealthSettings

DEFAULT_PORT = 30000  # SGLang's router default; `tokenloom serve` takes 8000


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def opt(name: str, kind, default, help: str, **kw) -> None:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=default,
                            help=help + (f" (default {default})" if default is not None else ""), **kw)

    parser.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                        help="the OpenAI-compatible servers to route to (http://host:port)")
    opt("policy", str, "cache_aware", "how a worker is chosen: " + " | ".join(POLICIES), choices=POLICIES)
    opt("host", str, "127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    opt("port", int, DEFAULT_PORT, "port to listen on (0: any free port)")
    opt("cache_threshold", float, 0.3, "cache_aware: route by prefix when the best match covers more than this "
        "share of the prompt, else to the worker with the smallest prefix record")
    opt("balance_abs_threshold", int, 64, "cache_aware: the load is unbalanced (route to the least loaded) when the "
        "busiest worker has more than this many open requests over the idlest ...")
    opt("balance_rel_threshold", float, 1.5, "... and more than this many times as many")
    opt("max_tree_size", int, 1 << 20, "cache_aware: prompt chunks (32 characters) remembered per worker")
    opt("health_check_interval_secs", float, 10.0, "seconds between health checks of every worker")
    opt("health_check_timeout_secs", float, 5.0, "a health check slower than this fails")
    opt("health_failure_threshold", int, 3, "failed checks in a row that take a worker out")
    opt("health_success_threshold", int, 2, "good checks in a row that bring it back")
    opt("health_check_endpoint", str, "/health", "path checked on each worker")
    opt("retry_max_retries", int, 2, "retries on another worker of a request that has not started")
    opt("request_timeout_secs", float, 1800.0, "give up on a worker silent for this many seconds")
    opt("max_payload_size", int, DEFAULT_MAX_PAYLOAD, "larger request bodies get 413")
    parser.add_argument("--pd-disaggregation", "--pd", dest="pd", action="store_true",
                        help="prefill/decode mode: completions go to a --prefill worker, then to a --decode worker "
                             "that pulls the KV cache and streams the answer")
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="PD mode: prefill instances (--splitwise-role prefill)")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                        help="PD mode: decode instances (--splitwise-role decode)")
    parser.add_argument("--kv-secret", dest="kv_secret", default=env_default("kv_secret", None, str),
                        help="PD mode: the kv_secret of the --prefill and --decode servers' --kv-transfer-config "
                             "(or their TOKENLOOM_KV_SECRET), sent with each completion so that they take its "
                             "kv_transfer_params")
    opt("log_level", str, "info", "debug | info | warning | error")
    add_cors_args(parser)
    add_connection_args(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    if args.pd:
        if args.worker_urls:
            raise ConfigError("--pd takes --prefill and --decode URLs, not --worker-urls")
        if not args.prefill or not args.decode:
            raise ConfigError("--pd needs at least one --prefill URL and one --decode URL")
        if not args.kv_secret:
            raise ConfigError("--pd needs --kv-secret (or TOKENLOOM_KV_SECRET): the kv_secret its prefill and decode "
                              "servers share, without which they refuse the router's kv_transfer_params")
    elif not args.worker_urls:
        raise ConfigError("give the workers with --worker-urls URL [URL ...] (or --pd --prefill URL --decode URL)")
    elif args.prefill or args.decode:
        raise ConfigError("--prefill and --decode need --pd")
    for url in [*args.worker_urls, *args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"worker URL {url!r} must start with http:// or https://")
    for name in ("health_check_interval_secs", "health_check_timeout_secs", "request_timeout_secs"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("health_failure_threshold", "health_success_threshold", "max_payload_size", "max_tree_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.retry_max_retries < 0 or not 0 <= args.cache_threshold <= 1 or args.balance_rel_threshold < 1:
        raise ConfigError("need --retry-max-retries >= 0, 0 <= --cache-threshold <= 1, --balance-rel-threshold >= 1")
    health = HealthSettings(endpoint=args.health_check_endpoint, interval=args.health_check_interval_secs,
                            timeout=args.health_check_timeout_secs, failure_threshold=args.health_failure_threshold,
                            success_threshold=args.health_success_threshold)
    return RouterSettings(worker_urls=args.worker_urls, policy=args.policy, cache_threshold=args.cache_threshold,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size,
                          health=health, max_retries=args.retry_max_retries, request_timeout=args.request_timeout_secs,
                          max_payload_size=args.max_payload_size, pd=args.pd, prefill_urls=args.prefill,
                          decode_urls=args.decode, cors=CorsSettings.from_args(args),
                          kv_secret=args.kv_secret)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # relayed SSE chunks are small writes
    sock.bind((host, port))
    sock.listen(2048)
    return sock


async def _serve(settings: RouterSettings, sock: socket.socket, log_level: str, limits: ConnectionLimits) -> None:
    import uvicorn

    config = uvicorn.Config(build_router_app(settings), log_level=log_level, access_log=False, lifespan="on",
                            **limits.uvicorn_options())
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if server.started:
            n = len(settings.worker_urls)
            workers = (f"{len(settings.prefill_urls)} prefill + {len(settings.decode_urls)} decode workers"
                       if settings.pd else f"{n} worker{'s' * (n != 1)}")
            print(f"tokenloom router at http://{shown}:{port} | policy {settings.policy} | {workers}", flush=True)

    task = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        task.cancel()


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health check
    settings = settings_from_args(args)
    limits = ConnectionLimits.from_args(args)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        asyncio.run(_serve(settings, sock, args.log_level.lower(), limits))
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom router", description=__doc__.splitlines()[0])
    try:
        return run_router(add_router_args(parser).parse_args(argv))
    except ConfigError as e:
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
