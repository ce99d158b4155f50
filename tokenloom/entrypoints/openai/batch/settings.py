"""The batch flags of `tokenloom serve` (each also a TOKENLOOM_<NAME> variable) and their defaults."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.config import env_default

# Upload size: large enough for tens of thousands of chat lines, small enough to hold in memory while it is
# checked and stored (OpenAI allows 200 MB per batch input file).
DEFAULT_MAX_UPLOAD_BYTES = 100 * 2 ** 20
# Requests per batch: OpenAI's limit.
DEFAULT_MAX_BATCH_REQUESTS = 50_000
# One line: the largest request body the server takes over HTTP (app.DEFAULT_MAX_BODY_BYTES).
DEFAULT_MAX_LINE_BYTES = 16 * 2 ** 20
# Batch requests in the engine at once, over all batches: enough to fill a CPU engine's batch, while
# interactive requests (more urgent: batch requests have a larger priority number) still get in first.
DEFAULT_BATCH_CONCURRENCY = 16
# The engine's priority of batch requests (lower runs first; interactive requests default to 0).
BATCH_PRIORITY = 10


def default_store_dir() -> Path:
    return Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom") / "batches"


@dataclass
class BatchSettings:
    store_dir: Path = field(default_factory=default_store_dir)
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_requests: int = DEFAULT_MAX_BATCH_REQUESTS
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    concurrency: int = DEFAULT_BATCH_CONCURRENCY

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchSettings:
        return cls(store_dir=Path(args.batch_store_dir) if args.batch_store_dir else default_store_dir(),
                   max_upload_bytes=args.max_upload_bytes, max_requests=args.batch_max_requests,
                   max_line_bytes=args.batch_max_line_bytes, concurrency=max(1, args.batch_concurrency))


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("files and batches (/v1/files, /v1/batches)")

    def opt(name: str, kind: type, default: int | str | None, help: str) -> None:
        shown = f" (default {default})" if default is not None else ""
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=env_default(name, default, kind),
                       help=help + shown)

    opt("batch_store_dir", str, None, "folder of the batch store (uploaded files, batches and their results, kept "
        "across restarts; default: $TOKENLOOM_CACHE_DIR/batches or ~/.cache/tokenloom/batches)")
    opt("max_upload_bytes", int, DEFAULT_MAX_UPLOAD_BYTES, "larger file uploads to /v1/files get 413")
    opt("batch_max_requests", int, DEFAULT_MAX_BATCH_REQUESTS, "most requests (lines) in one batch")
    opt("batch_max_line_bytes", int, DEFAULT_MAX_LINE_BYTES, "longest line of a batch input file")
    opt("batch_concurrency", int, DEFAULT_BATCH_CONCURRENCY, "batch requests in the engine at once, over all "
        "batches (they run at a lower priority than interactive requests)")
