"""`tokenloom serve`: the API server process (uvicorn) plus the EngineCore process.

Start-up: the options are checked and the port is bound first, so a port in use or a bad
option fails at once, before the model loads. Then the engine process loads the weights and
allocates the KV cache (it prints its own progress bars), the tokenizer loads meanwhile,
uvicorn starts on the bound socket and one line says where the server is, which model, the
KV blocks and how many full-length requests fit. Every start-up error is one line
``tokenloom: error: ...`` (``--debug``: with the traceback).

Shutdown (SIGTERM / SIGINT): stop accepting, answer new requests on open connections
with 503, give in-flight requests ``--shutdown-timeout`` seconds, end the rest with an
error, stop the engine process, exit 0. A second signal skips the wait. The engine
process dies with this one even when it is killed (PR_SET_PDEATHSIG + parent watch).

Engine faults: a dead engine process (crash, killed), a frozen one (no heartbeat for
``--engine-heartbeat-timeout`` s) or a hung step (``--engine-step-timeout`` s) fails
every in-flight request (500 ``engine_dead``) and turns /health to 503; with
``--restart-engine`` a fresh engine process is started (new requests get 503 meanwhile,
``tokenloom:engine_restarts_total`` counts it), otherwise the server exits with code 1 so
that a supervisor restarts it.

Every option can also be set with an environment variable ``TOKENLOOM_<NAME>``
(e.g. ``TOKENLOOM_PORT=9000``, ``TOKENLOOM_API_KEY=...``); a flag wins over it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
from types import FrameType

import uvicorn

from tokenloom.config import EngineConfig, add_engine_args, env_default
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.generation_defaults import load_generation_defaults
from tokenloom.engine.request_log import LOG_LEVELS
from tokenloom.entrypoints.compat import add_common_args, apply_threads, check_common_args, read_chat_template
from tokenloom.entrypoints.lora_modules import parse_lora_modules, runtime_updates_from_env
from tokenloom.entrypoints.openai.batch.settings import BatchSettings, add_batch_args
from tokenloom.entrypoints.openai.server_settings import DEFAULT_MAX_BODY_BYTES, ServerSettings
from tokenloom.entrypoints.openai.server_state import (
    DEFAULT_MAX_EXPECTED_LATENCY,
    DEFAULT_MAX_QUEUE_WAIT,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_STREAM_WRITE_TIMEOUT,
    ServerShuttingDownError,
    ServerState,
)
from tokenloom.env_vars import vllm_dev_mode
from tokenloom.exposure.connections import ConnectionLimits, add_connection_args
from tokenloom.exposure.cors import CorsSettings, add_cors_args
from tokenloom.lora.adapter import LoRAAdapterError
from tokenloom.model.model_path import resolve_model_path
from tokenloom.tracing import TracingUnavailableError, init_tracer

logger = logging.getLogger("tokenloom.server")


def _json_object(raw: str) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {raw}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {raw}")
    return value


_json_object.__name__ = "JSON object"


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Engine flags plus the server's; each defaults to TOKENLOOM_<NAME> when set."""
    add_engine_args(parser)
    parser.add_argument("-m", "--model", dest="model_option", default=None,
                        help="the model, as an option (same as the positional argument)")
    g = parser.add_argument_group("server")

    def opt(name: str, kind, default, help: str, dest_override: str | None = None, **kw) -> None:
        flags = ["--" + name.replace("_", "-")] + (["-np"] if name == "parallel" else [])
        g.add_argument(*flags, dest=dest_override or name, type=kind,
                       default=argparse.SUPPRESS if dest_override else env_default(name, default, kind),
                       help=help + (f" (default {default})" if default is not None else ""), **kw)

    def flag(name: str, help: str) -> None:
        g.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true",
                       default=env_default(name, False, bool), help=help)

    opt("host", str, "127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    opt("port", int, 8000, "port to listen on (0: any free port)")
    g.add_argument("--served-model-name", "-a", "--alias", dest="served_model_name", nargs="+",
                   default=_env_names(env_default("served_model_name", None, str)),
                   help="model name(s) clients send and see; the first is the one reported and used as the "
                        "metrics' model_name, the others are aliases (default: the model argument)")
    g.add_argument("--lora-modules", dest="lora_modules", nargs="+", default=None,
                   help="LoRA adapters to serve (with --enable-lora), each name=path or a JSON object "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request picks one by its "
                        "model field")
    flag("allow_runtime_lora_updating", "open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    opt("api_key", str, None, "require 'Authorization: Bearer KEY' on every endpoint but /health (/metrics "
        "included)")
    g.add_argument("--protect-metrics", action="store_true", default=argparse.SUPPRESS,
                   help="accepted for old command lines: with --api-key, /metrics always needs the key")
    opt("shutdown_timeout", float, 30.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT")
    opt("max_request_body_bytes", int, DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413")
    opt("log_requests", str, "off", "request logging: off | lifecycle | stages | full", choices=LOG_LEVELS)
    opt("log_level", str, "info", "log level of the server and engine: debug | info | warning | error")
    flag("access_log", "log one line per HTTP request (uvicorn access log)")
    opt("engine_heartbeat_timeout", float, 10.0, "declare the engine dead after this many seconds of silence")
    opt("engine_step_timeout", float, 30.0, "declare the engine hung when one step runs this many seconds "
        "(0: never)")
    flag("restart_engine", "restart the engine process when it dies or hangs (otherwise the server exits with "
         "code 1)")
    opt("max_waiting_requests", int, DEFAULT_MAX_WAITING_REQUESTS,
        "most sequences waiting for a slot in the running batch; beyond it requests get 503 with Retry-After "
        "(-1: no limit)")
    opt("request_timeout", float, 0.0, "end a request (504 request_timeout) that waited and ran longer than this "
        "many seconds; a request's own 'timeout' field can only lower it (0: none)")
    opt("engine_startup_timeout", float, None, "give up if the engine is not ready within this many seconds")
    opt("metrics_prefix", str, "tokenloom", "prefix of the /metrics names; 'vllm' makes vLLM's Grafana dashboards "
        "work unchanged")
    g.add_argument("--no-ui", dest="enable_ui", action="store_false", default=not env_default("no_ui", False, bool),
                   help="do not serve the web page (live engine view and chat playground) at /")
    opt("parallel", int, None, "llama.cpp's name of --max-num-seqs", dest_override="max_num_seqs")
    g.add_argument("--enable-weight-updates", dest="enable_weight_updates", action="store_true",
                   default=env_default("enable_weight_updates", False, bool),
                   help="open /update_weights_from_disk, the weight-sync group endpoints and /pause_generation, "
                        "/continue_generation (serving inside a training loop; docs/training.md)")
    g.add_argument("--enable-sleep-mode", dest="enable_sleep_mode", action="store_true",
                   default=env_default("enable_sleep_mode", False, bool),
                   help="open /sleep?level=1|2, /wake_up and /is_sleeping (vLLM's flag)")

    add_cors_args(parser)
    add_connection_args(parser)

    v = parser.add_argument_group("vLLM server flags")
    v.add_argument("--response-role", default="assistant",
                   help="role of the generated message; only 'assistant' is supported")
    v.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                   help='accepted: tool_choice "auto" is always on, parsed with --tool-call-parser')
    v.add_argument("--generation-config", default=env_default("generation_config", "auto", str),
                   help="sampling defaults: 'auto' (the model folder's generation_config.json), 'vllm' (none), "
                        "or a folder holding a generation_config.json")
    v.add_argument("--override-generation-config", type=_json_object, default=None,
                   help='JSON object of sampling defaults over the generation config, e.g. \'{"temperature": 0.5}\'')
    v.add_argument("--uvicorn-log-level", default=None,
                   choices=["debug", "info", "warning", "error", "critical", "trace"],
                   help="log level of uvicorn only (default: --log-level)")
    v.add_argument("--disable-log-requests", dest="log_requests", action="store_const", const="off",
                   default=argparse.SUPPRESS, help="no request log lines (the default; see --log-requests)")
    v.add_argument("--enable-log-requests", dest="log_requests", action="store_const", const="lifecycle",
                   default=argparse.SUPPRESS,
                   help="one log line per request received and finished (= --log-requests lifecycle)")
    v.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   default=argparse.SUPPRESS, help="no access log (the default; see --access-log)")
    v.add_argument("--ssl-keyfile", default=env_default("ssl_keyfile", None, str), help="serve HTTPS with this key")
    v.add_argument("--ssl-certfile", default=env_default("ssl_certfile", None, str),
                   help="serve HTTPS with this certificate")
    v.add_argument("--root-path", default=env_default("root_path", "", str),
                   help="path prefix when the server sits behind a path-based proxy")
    add_common_args(parser)
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks of start-up errors")
    # ---- admission by expected wait, stalled streams, request templates
    opt("max_expected_latency", float, DEFAULT_MAX_EXPECTED_LATENCY,
        "answer 503 with Retry-After at once when a new request's expected time to complete (its wait plus its "
        "own decode in the batch it joins, from the engine's measured speed) exceeds this many seconds (0: no limit)")
    opt("max_queue_wait", float, DEFAULT_MAX_QUEUE_WAIT,
        "the same for the expected wait alone, before the request's first token (0: no limit)")
    opt("stream_write_timeout", float, DEFAULT_STREAM_WRITE_TIMEOUT,
        "end a streamed response whose client has not taken a chunk for this many seconds (0: never)")
    flag("trust_request_chat_template", "render a chat_template sent with a request (in a separate process with "
         "memory and time limits); otherwise such requests get 400")
    opt("otlp_traces_endpoint", str, None, "export OpenTelemetry request spans to this OTLP endpoint "
        "(e.g. http://localhost:4317); off by default")
    add_batch_args(parser)
    return parser


def _env_names(raw: str | None) -> list[str] | None:
    return raw.replace(",", " ").split() if raw else None


class _Server(uvicorn.Server):
    """uvicorn with a draining shutdown: signals start `drain()` instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # called from the signal handler
        loop = self.loop
        if self.state.draining or loop is None:
            logger.warning("second signal: shutting down now")
            self.force_exit = True
            self.should_exit = True
            if loop is not None:
                loop.call_soon_threadsafe(self.engine.fail_all, ServerShuttingDownError("the server is shutting down"))
            return
        self.state.draining = True
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        for server in self.servers:  # stop accepting connections
            server.close()
        n = self.engine.num_inflight
        logger.info("shutting down: %d request(s) in flight, waiting up to %.0f s", n, self.shutdown_timeout)
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_inflight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.engine.num_inflight:
            logger.warning("shutdown timeout: ending %d request(s) with an error", self.engine.num_inflight)
            self.engine.fail_all(ServerShuttingDownError("the server is shutting down"))
            await asyncio.sleep(0.5)  # let the error responses go out
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """Listen before the model loads, so a port in use fails at once. TCP_NODELAY is set here and
    inherited by every accepted connection: streamed tokens are small writes that Nagle would delay."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def ready_line(url: str, engine: AsyncLLM) -> str:
    """The one line that says the server is up: where, the parallel layout, and what the KV cache holds (an
    embedding engine's requests are single prefills: its context instead)."""
    info = engine.info
    kv = info.kv_cache if info is not None else None
    tp = info.tensor_parallel_size if info is not None else 1
    max_len = engine.max_model_len
    dp = engine.data_parallel_size
    layout = f"{dp} engine replicas (data parallel), each tensor parallel {tp}" if dp > 1 else f"tensor parallel {tp}"
    if info is not None and info.pooling is not None:
        capacity = f"embeddings of up to {max_len} tokens an input"
    elif kv is not None:
        capacity = (f"KV cache: {kv.num_blocks} blocks x {kv.block_size} tokens | {kv.full_length_requests} "
                    f"full-length ({max_len}-token) requests fit")
    else:
        capacity = "KV cache: unknown"
    return f"tokenloom serving {engine.served_model_name} at {url} | {layout} | {capacity}"


ENGINE_RESTART_ATTEMPTS = 3


def _handle_engine_death(server: _Server, engine: AsyncLLM, args: argparse.Namespace, reason: str) -> None:
    """Called once per engine death, after every in-flight request failed."""
    if server.state.draining or server.should_exit:
        return
    if getattr(args, "restart_engine", False):
        logger.error("the engine died (%s); restarting it", reason)
        asyncio.ensure_future(_restart_engine(server, engine, args))
        return
    logger.error("the engine died (%s); the server exits (code 1). Use --restart-engine to restart it instead.",
                 reason)
    server.exit_code = 1

    async def stop() -> None:
        await asyncio.sleep(1.0)  # let the in-flight requests' error responses go out
        server.should_exit = True

    asyncio.ensure_future(stop())


async def _restart_engine(server: _Server, engine: AsyncLLM, args: argparse.Namespace) -> None:
    for attempt in range(1, ENGINE_RESTART_ATTEMPTS + 1):
        if server.state.draining or server.should_exit:
            return
        try:
            await engine.restart(startup_timeout=args.engine_startup_timeout)
            logger.warning("engine restarted (attempt %d)", attempt)
            return
        except Exception as e:  # noqa: BLE001
            logger.error("engine restart attempt %d failed: %s", attempt, e)
            await asyncio.sleep(min(30.0, 2.0 ** attempt))
    logger.error("the engine could not be restarted; the server exits (code 1)")
    server.exit_code = 1
    server.should_exit = True


def _handle_replica_death(server: _Server, engine: AsyncLLM, args: argparse.Namespace, rank: int,
                          reason: str) -> None:
    """Data parallel: one replica died while others serve (its requests have failed). With --restart-engine
    it is restarted; otherwise the server goes on without it (/health says "degraded")."""
    if server.state.draining or server.should_exit:
        return
    if not getattr(args, "restart_engine", False):
        logger.error("engine replica %d died (%s); serving on the other replicas (--restart-engine restarts it)",
                     rank, reason)
        return
    logger.error("engine replica %d died (%s); restarting it", rank, reason)

    async def restart() -> None:
        for attempt in range(1, ENGINE_RESTART_ATTEMPTS + 1):
            if server.state.draining or server.should_exit:
                return
            try:
                await engine.restart_replica(rank, startup_timeout=args.engine_startup_timeout)
                return
            except Exception as e:  # noqa: BLE001
                logger.error("restart attempt %d of engine replica %d failed: %s", attempt, rank, e)
                await asyncio.sleep(min(30.0, 2.0 ** attempt))
        logger.error("engine replica %d could not be restarted; serving on the other replicas", rank)

    asyncio.ensure_future(restart())


class StartupError(RuntimeError):
    """A start-up failure already phrased for the user (one line)."""


def _check_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch  # lazy: only --device cuda needs it, the API process does not otherwise
        if not torch.cuda.is_available():
            raise StartupError(f"--device {device}: no CUDA device is available (use --device cpu)")


def _check_kv_trust(config: EngineConfig) -> None:
    """A server in a prefill/decode pair needs a way to tell its router from any client (kv_transfer/trust.py)."""
    kv = config.kv_transfer_config
    if kv is None or kv.kv_secret or (not kv.is_producer and kv.kv_producers):
        return
    raise StartupError('a prefill/decode server takes kv_transfer_params only from its router: set "kv_secret" in '
                       "--kv-transfer-config (or TOKENLOOM_KV_SECRET) and give `tokenloom router --pd` the same "
                       '--kv-secret (a decode-only server may instead list its producers in "kv_producers")')


def prepare(args: argparse.Namespace) -> tuple[EngineConfig, list[str], ServerSettings | None, socket.socket | None]:
    """Everything that can fail fast, before the model loads: options, model path, device, port.
    Returns (config, served model names, settings, socket)."""
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            raise StartupError(f"two models given: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    check_common_args(args)
    if args.response_role != "assistant":
        raise StartupError(f"--response-role {args.response_role}: only 'assistant' is supported")
    names = list(args.served_model_name or [])
    args.served_model_name = names[0] if names else None
    config = EngineConfig.from_args(args)
    names = names or [config.model.served_model_name or config.model.model]
    args.lora_module_list = parse_lora_modules(args.lora_modules)
    if args.lora_module_list and not config.lora.enable_lora:
        raise StartupError("--lora-modules needs --enable-lora")
    for module in args.lora_module_list:  # the files, before the model loads (their shapes once it has)
        from tokenloom.lora.adapter_files import read_adapter_spec  # lazy: its GGUF reader imports torch
        try:
            read_adapter_spec(module.path)
        except LoRAAdapterError as e:
            raise StartupError(f"--lora-modules {module.name}: {e}") from None
    args.chat_template_text = read_chat_template(args.chat_template)
    if args.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(args.generation_config, "generation_config.json")):
        raise StartupError(f"--generation-config {args.generation_config}: no generation_config.json there")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise StartupError(f"--{flag.replace('_', '-')} {path}: no such file")
    _check_kv_trust(config)
    resolve_model_path(config.model.model)  # raises FileNotFoundError naming the path
    _check_device(config.model.device)
    if config.parallel.node_rank > 0:  # workers only: node 0 runs the engine and the API
        return config, names, None, None
    apply_threads(args.threads)
    os.environ["TOKENLOOM_METRICS_PREFIX"] = args.metrics_prefix
    settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                              max_body_bytes=args.max_request_body_bytes, cors=CorsSettings.from_args(args),
                              connections=ConnectionLimits.from_args(args), enable_ui=args.enable_ui,
                              batch=BatchSettings.from_args(args),
                              enable_weight_updates=args.enable_weight_updates or vllm_dev_mode(),
                              enable_sleep_mode=args.enable_sleep_mode or vllm_dev_mode(),
                              allow_runtime_lora_updating=(args.allow_runtime_lora_updating
                                                           or runtime_updates_from_env()))
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        raise StartupError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return config, names, settings, sock


def _apply_generation_config(engine: AsyncLLM, args: argparse.Namespace) -> None:
    if args.generation_config == "vllm":
        engine.generation_defaults = {}
    elif args.generation_config != "auto":
        engine.generation_defaults = load_generation_defaults(args.generation_config)
    if args.override_generation_config:
        override = dict(args.override_generation_config)
        if "max_new_tokens" in override:  # the generation_config.json spelling
            override["max_tokens"] = override.pop("max_new_tokens")
        engine.generation_defaults.update(override)
    if args.chat_template_text is not None:
        engine.tokenizer.chat_template = args.chat_template_text


async def serve(args: argparse.Namespace) -> int:
    config, names, settings, sock = prepare(args)
    if sock is None:  # a node > 0 of a multi-node engine: workers only (imported here: they need torch)
        from tokenloom.executor.headless import run_headless  # lazy: it needs torch, the API process does not
        return run_headless(config)
    print(f"tokenloom: starting the engine for {config.model.model} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    engine = AsyncLLM(config, served_model_name=names[0], heartbeat_timeout=args.engine_heartbeat_timeout,
                      log_requests=args.log_requests, step_timeout=args.engine_step_timeout)
    engine.launch()  # the engine process imports torch and loads the weights while this one imports FastAPI
    # The HTTP stack (0.4 s of imports) loads after the engine process is launched, not before it.
    from tokenloom.entrypoints.openai.app import build_app  # lazy: after the engine's launch
    from tokenloom.entrypoints.openai.errors import BadRequestError  # lazy: after the engine's launch
    from tokenloom.entrypoints.openai.lora_models import LoRAModels  # lazy: after the engine's launch
    try:
        await engine.start(startup_timeout=args.engine_startup_timeout)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        engine.client.shutdown()
        sock.close()
        raise StartupError(f"the engine failed to start: {e}") from e
    print(f"tokenloom: engine ready in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    _apply_generation_config(engine, args)

    state = ServerState(max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout,
                        trust_request_chat_template=args.trust_request_chat_template,
                        max_queue_wait=args.max_queue_wait,
                        max_expected_latency=args.max_expected_latency, stream_write_timeout=args.stream_write_timeout)
    state.lora_models = LoRAModels(engine, names[0], config.lora.enable_lora)
    for module in args.lora_module_list:
        try:
            await state.lora_models.add(module, names)
        except BadRequestError as e:
            engine.shutdown()
            sock.close()
            raise StartupError(f"--lora-modules {module.name}: {e.message}") from e
    if args.otlp_traces_endpoint:
        try:
            engine.tracer = init_tracer("tokenloom.api_server", args.otlp_traces_endpoint)
        except TracingUnavailableError as e:
            engine.shutdown()
            sock.close()
            raise StartupError(str(e)) from e
    app = build_app(engine, settings, state)
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    scheme = "https" if args.ssl_certfile else "http"
    uv_config = uvicorn.Config(app, log_level=(args.uvicorn_log_level or args.log_level).lower(),
                               access_log=args.access_log, timeout_graceful_shutdown=5, lifespan="off",
                               ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                               **settings.connections.uvicorn_options())
    server = _Server(uv_config, engine, state, args.shutdown_timeout)
    server.loop = asyncio.get_running_loop()
    engine.on_engine_dead = lambda reason: _handle_engine_death(server, engine, args, reason)
    engine.on_replica_dead = lambda rank, reason: _handle_replica_death(server, engine, args, rank, reason)
    if not engine.is_healthy:  # died during start-up already
        _handle_engine_death(server, engine, args, engine.dead_reason or "engine not running")

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if server.started:
            print(ready_line(f"{scheme}://{shown_host}:{port}", engine), flush=True)

    announcer = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        engine.shutdown()
        sock.close()
    logger.info("tokenloom server stopped")
    return server.exit_code


def run_server(args: argparse.Namespace) -> int:
    """Errors of start-up become one `tokenloom: error: ...` line; --debug (or TOKENLOOM_DEBUG=1) shows
    the traceback, the engine process's included."""
    debug = getattr(args, "debug", False) or os.environ.get("TOKENLOOM_DEBUG") == "1"
    if debug:
        os.environ["TOKENLOOM_DEBUG"] = "1"
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # also when the CLI configured logging first
    if args.log_requests != "off":  # request lines are INFO: keep them visible at any --log-level
        logging.getLogger("tokenloom.requests").setLevel(logging.INFO)
    os.environ["TOKENLOOM_LOG_LEVEL"] = logging.getLevelName(level)  # for the engine process
    try:
        return asyncio.run(serve(args))
    except (StartupError, ValueError, OSError) as e:  # ConfigError is a ValueError
        if debug:
            raise
        print(f"tokenloom: error: {e}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
