"""`tokenloom run-batch -i in.jsonl -o out.jsonl`: a JSONL file of OpenAI requests, answered offline.

vLLM's `run-batch`: each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with a url of
`endpoints.BATCH_ENDPOINTS`; each output line ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``, in input order. The engine and the serving objects are built once and the
routes' handlers called in process (no HTTP), so a line is answered exactly as the server would answer it.
A bad line is answered with an error line; it never stops the batch. Output lines are written as soon as
every line before them is done, so an interrupted run keeps its finished prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from tokenloom.config import EngineConfig, add_engine_args
from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.compat import add_common_args, apply_threads, check_common_args, read_chat_template
from tokenloom.entrypoints.openai.batch.endpoints import BATCH_ENDPOINTS, EndpointCaller
from tokenloom.entrypoints.openai.batch.lines import (
    BatchLine,
    LineError,
    answer_line,
    dumps,
    error_line,
    parse_lines,
    split_lines,
)
from tokenloom.entrypoints.openai.batch.settings import DEFAULT_MAX_LINE_BYTES
from tokenloom.entrypoints.openai.server_state import ServerState

# Requests in the engine at once: enough to fill the default scheduler batch (--max-num-seqs).
DEFAULT_MAX_CONCURRENCY = 256


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="JSONL file of requests")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL file of answers (written in input order)")
    parser.add_argument("-m", "--model", dest="model", default=None,
                        help="GGUF file, model folder, or the embedded default")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name request bodies may give (default: the model argument)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                        help=f"requests in the engine at once (default {DEFAULT_MAX_CONCURRENCY})")
    parser.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                        help=f"longer input lines are answered with an error (default {DEFAULT_MAX_LINE_BYTES})")
    parser.add_argument("--log-level", default="warning", help="log level (default warning)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    add_engine_args(parser, model_positional=False)
    add_common_args(parser)


class OrderedWriter:
    """Writes output lines in input order as soon as each one's predecessors are written."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.pending: dict[int, str] = {}
        self.next_index = 0

    def put(self, index: int, output: JsonObject) -> None:
        self.pending[index] = dumps(output)
        while self.next_index in self.pending:
            self.out.write(self.pending.pop(self.next_index) + "\n")
            self.next_index += 1
        self.out.flush()


async def answer_all(caller: EndpointCaller, items: list[BatchLine | LineError], writer: OrderedWriter,
                     concurrency: int, progress: tqdm) -> None:
    """Every line answered through `caller`, at most `concurrency` at a time."""
    pending = iter(items)

    async def worker() -> None:
        for item in pending:
            if isinstance(item, LineError):
                writer.put(item.index, error_line(item))
            else:
                writer.put(item.index, answer_line(item, await caller.call(item.url, item.body)))
            progress.update(1)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items))))))


async def _run(ns: argparse.Namespace, items: list[BatchLine | LineError]) -> int:
    config = EngineConfig.from_args(ns)
    name = ns.served_model_name or config.model.model
    engine = AsyncLLM(config, served_model_name=name)
    await engine.start()
    try:
        template = read_chat_template(ns.chat_template)
        if template is not None and engine.tokenizer is not None:
            engine.tokenizer.chat_template = template
        # Offline: every line is admitted; the workers bound what is in the engine.
        state = ServerState(max_waiting_requests=-1, max_expected_latency=0, max_queue_wait=0)
        caller = EndpointCaller(engine, [name], state)
        with open(ns.output_file, "w", encoding="utf-8") as out, \
                tqdm(total=len(items), desc="run-batch", unit="req", file=sys.stderr) as progress:
            await answer_all(caller, items, OrderedWriter(out), ns.max_concurrency, progress)
    finally:
        engine.shutdown()
    return 0


def run_batch(ns: argparse.Namespace) -> int:
    check_common_args(ns)
    apply_threads(ns.threads)
    level = getattr(logging, str(ns.log_level).upper(), logging.WARNING)
    logging.getLogger().setLevel(level)
    os.environ["TOKENLOOM_LOG_LEVEL"] = logging.getLevelName(level)  # for the engine process
    content = Path(ns.input_file).read_bytes()  # a missing file: one error line from the CLI
    items = parse_lines(split_lines(content), urls=set(BATCH_ENDPOINTS), max_line_bytes=ns.max_line_bytes)
    return asyncio.run(_run(ns, items))
