"""`tokenloom serve | generate | chat | bench`: the command line."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tokenloom.config import add_engine_args

# Errors a user can cause (bad path, bad option, bad model file): one line, no traceback.
USER_ERRORS = (FileNotFoundError, ValueError, RuntimeError, OSError)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=256)


def _params(ns):
    from tokenloom.sampling_params import SamplingParams
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens)


def _llm(ns):
    from tokenloom.config import EngineConfig
    from tokenloom.entrypoints.llm import LLM
    config = EngineConfig.from_args(ns)
    kwargs = {"kv_cache_memory": 0.25} if ns.kv_cache_memory is None and ns.num_blocks is None else {}
    flat = {**vars(config.model), **vars(config.cache), **vars(config.scheduler), **vars(config.parallel), **kwargs}
    return LLM(progress=not ns.quiet, **flat)


def cmd_generate(ns) -> int:
    llm = _llm(ns)
    prompt = ns.prompt if ns.raw else None
    params = _params(ns)
    if prompt is None:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def cmd_chat(ns) -> int:
    llm = _llm(ns)
    params = _params(ns)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("tokenloom chat — empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        if line == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        text = ""
        for out in llm.generate_stream(llm.tokenizer.encode(
                llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False),
                params):
            new = out.outputs[0].text
            print(new[len(text):], end="", flush=True)
            text = new
        print()
        messages.append({"role": "assistant", "content": text})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser. Subcommands other than `command` skip their heavy imports (FastAPI, httpx),
    so `tokenloom generate` starts faster; with command=None everything is wired."""
    parser = argparse.ArgumentParser(prog="tokenloom", description="LLM inference and serving engine")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt and print it")
    p.add_argument("prompt")
    p.add_argument("--model", dest="model", default=None, help="GGUF file, model folder, or the embedded default")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_engine_args(p, model_positional=False)
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--model", dest="model", default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p, model_positional=False)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if command in (None, "serve"):
        try:
            from tokenloom.entrypoints.openai.api_server import add_serve_args, run_server
            add_serve_args(p)
            p.set_defaults(func=run_server)
        except ImportError as exc:  # pragma: no cover - only while the server package is incomplete
            reason = f"serve is unavailable: {exc}"
            p.set_defaults(func=lambda ns: _fail(reason))

    p = sub.add_parser("bench", help="benchmarks: throughput (offline), serve (HTTP load)")
    if command in (None, "bench"):
        from tokenloom.bench.cli import add_bench_args
        add_bench_args(p)
    return parser


def _fail(message: str) -> int:
    print(f"tokenloom: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = next((a for a in args if not a.startswith("-")), None)
    debug = "--debug" in args or os.environ.get("TOKENLOOM_DEBUG") == "1"
    try:
        ns = build_parser(command).parse_args(args)  # TOKENLOOM_<NAME> defaults are read here
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return ns.func(ns) or 0
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as exc:
        if debug:
            raise
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
