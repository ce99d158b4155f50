"""`tokenloom serve | generate | chat | run-batch | bench | router`: the command line.

`generate` and `chat` are for a person at a terminal: tokens are printed as they come, and
nothing else is (no progress bars, no log lines, no periodic engine stats) unless `-v`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING

import tokenloom
from tokenloom.config import ConfigError, EngineConfig, add_engine_args
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.entrypoints.chat_session import ChatSession
from tokenloom.entrypoints.compat import add_common_args, apply_threads, check_common_args, read_chat_template
from tokenloom.entrypoints.lora_modules import parse_lora_module
from tokenloom.entrypoints.terminal import chat_prompt_ids, stream_reply

if TYPE_CHECKING:  # imported when run: the LLM pulls in torch
    from tokenloom.entrypoints.llm import LLM

# Errors a user can cause (bad path, bad option, bad model file): one line, no traceback.
USER_ERRORS = (FileNotFoundError, ValueError, RuntimeError, OSError)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", "-n", "--n-predict", dest="max_tokens", type=int, default=256,
                   help="most tokens per reply (default 256)")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", dest="model", default=None,
                        help="GGUF file, model folder, or the embedded default")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show progress bars and the engine's log lines (on stderr)")
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    add_engine_args(parser, model_positional=False)
    parser.add_argument("--lora", dest="lora", default=None,
                        help="answer with a LoRA adapter: name=path (a PEFT folder); turns --enable-lora on")
    add_common_args(parser)
    _sampling_args(parser)


def _lora(ns: argparse.Namespace) -> LoRARequest | None:
    if ns.lora is None:
        return None
    module = parse_lora_module(ns.lora, "--lora")
    return LoRARequest(module.name, 1, module.path, module.base_model_name)


def _params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens)


def _llm(ns: argparse.Namespace) -> LLM:
    """An in-process LLM; quiet unless -v (warnings such as 'max_model_len clamped' included)."""
    from tokenloom.entrypoints.llm import LLM  # lazy: CLI start-up time (it imports torch and the model code)
    check_common_args(ns)
    template = read_chat_template(ns.chat_template)
    apply_threads(ns.threads)
    logging.getLogger().setLevel(logging.INFO if ns.verbose else logging.ERROR)
    if not ns.verbose:
        warnings.filterwarnings("ignore")
    if ns.lora is not None:
        ns.enable_lora = True
    config = EngineConfig.from_args(ns)
    kwargs = {"kv_cache_memory": 0.25} if ns.kv_cache_memory is None and ns.num_blocks is None else {}
    flat = {**vars(config.model), **vars(config.cache), **vars(config.scheduler), **vars(config.parallel), **kwargs,
            **vars(config.lora), "log_stats_interval": config.log_stats_interval if ns.verbose else 0.0}
    llm = LLM(progress=ns.verbose, **flat)
    if template is not None:
        llm.tokenizer.chat_template = template
    return llm


def cmd_generate(ns) -> int:
    llm = _llm(ns)
    prompt = ns.prompt if ns.raw else chat_prompt_ids(llm, [{"role": "user", "content": ns.prompt}])
    stream_reply(llm, prompt, _params(ns), lora_request=_lora(ns))
    print()
    return 0


def cmd_chat(ns) -> int:
    return ChatSession(_llm(ns), _params(ns), ns.system, lora_request=_lora(ns)).run()


def cmd_cache(ns) -> int:
    """List the weight cache's entries (or empty it with --clear)."""
    from tokenloom.model.loader import weight_cache as wc  # lazy: CLI start-up time (the loader imports torch)

    held = wc.entries()
    if ns.clear:
        for entry in held:
            wc.remove(entry)
        print(f"removed {len(held)} entr{'y' if len(held) == 1 else 'ies'}, "
              f"{sum(e.bytes for e in held) / 2 ** 20:,.0f} MiB, from {wc.folder()}")
        return 0
    state = "" if wc.enabled() else " (disabled: TOKENLOOM_WEIGHT_CACHE=0)"
    print(f"weight cache {wc.folder()}{state}: {len(held)} entr{'y' if len(held) == 1 else 'ies'}, "
          f"{sum(e.bytes for e in held) / 2 ** 20:,.0f} MiB of {wc.max_bytes() / 2 ** 20:,.0f} MiB")
    for e in held:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        print(f"  {e.bytes / 2 ** 20:8,.0f} MiB  {e.dtype:9} last used {used}  {e.source}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage block), like every other error."""

    command: str | None = None  # set on the root: the subcommand whose --help to point to

    def error(self, message: str):
        prog = f"{self.prog} {self.command}" if self.command else self.prog
        raise ConfigError(f"{message} (see {prog} --help)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser. Subcommands other than `command` skip their heavy imports (FastAPI, httpx),
    so `tokenloom generate` starts faster; with command=None everything is wired."""
    parser = _Parser(prog="tokenloom", description="LLM inference and serving engine")
    parser.command = command
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", "-V", action="version", version=f"tokenloom {tokenloom.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt and print it as it is generated")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal (/help lists its commands)")
    p.add_argument("--system", default=None, help="system prompt")
    _model_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if command in (None, "serve"):
        try:
            from tokenloom.entrypoints.openai.api_server import (  # lazy: CLI start-up time (FastAPI, uvicorn)
                add_serve_args,
                run_server,
            )
            add_serve_args(p)
            p.set_defaults(func=run_server)
        except ImportError as exc:  # pragma: no cover - only while the server package is incomplete
            reason = f"serve is unavailable: {exc}"
            p.set_defaults(func=lambda ns: _fail(reason))

    p = sub.add_parser("router", help="HTTP proxy in front of several OpenAI-compatible servers (data parallel "
                                      "across servers, prefix-aware routing, prefill/decode pairs)")
    if command in (None, "router"):
        from tokenloom.router.cli import add_router_args, run_router  # lazy: CLI start-up time (httpx, FastAPI)
        add_router_args(p)
        p.set_defaults(func=run_router)

    p = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI requests offline (vLLM's batch format)")
    if command in (None, "run-batch"):
        from tokenloom.entrypoints.openai.batch.run_batch import (  # lazy: CLI start-up time (FastAPI, the engine)
            add_run_batch_args,
            run_batch,
        )
        add_run_batch_args(p)
        p.set_defaults(func=run_batch)

    p = sub.add_parser("cache", help="what the weight cache holds (--clear empties it)")
    p.add_argument("--clear", action="store_true", help="remove every entry")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("bench", help="benchmarks: throughput (offline), serve (HTTP load)")
    if command in (None, "bench"):
        from tokenloom.bench.cli import add_bench_args  # lazy: CLI start-up time
        add_bench_args(p)
    return parser


def _fail(message: str) -> int:
    print(f"tokenloom: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    commands = ("serve", "generate", "chat", "bench", "cache", "router", "run-batch")
    command = next((a for a in args if a in commands), None)
    debug = "--debug" in args or os.environ.get("TOKENLOOM_DEBUG") == "1"
    try:
        ns = build_parser(command).parse_args(args)  # TOKENLOOM_<NAME> defaults are read here
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        if debug:
            ns.debug = True
        return ns.func(ns) or 0
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as exc:
        if debug:
            raise
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
