"""Runs the server's batches in the background, and resumes the unfinished ones when the server starts.

Each batch is one task; its requests go through `EndpointCaller` (the routes' own handlers) at
`BATCH_PRIORITY`, a larger number than interactive requests' default 0, so the scheduler serves
interactive traffic first. One semaphore bounds the batch requests in the engine over all batches.

A result is stored the moment its request finishes. Answers that say "not now" rather than "this request
is wrong" (503: overloaded, restarting, shutting down; the engine dead) are not results: the request is
retried later, or, when the server is stopping, left for the next server, which runs every active batch's
lines that have no result. Cancelling disconnects the in-flight requests (the engine aborts them) and
finalizes the batch with what finished.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.openai.batch.endpoints import CANCELLED_STATUS, EndpointCaller, HandlerAnswer
from tokenloom.entrypoints.openai.batch.lines import (
    BatchLine,
    LineError,
    answer_line,
    dumps,
    error_line,
    line_succeeded,
    parse_lines,
    split_lines,
)
from tokenloom.entrypoints.openai.batch.objects import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    BatchRecord,
)
from tokenloom.entrypoints.openai.batch.settings import BATCH_PRIORITY, BatchSettings
from tokenloom.entrypoints.openai.batch.store import BatchStore
from tokenloom.entrypoints.openai.server_state import ServerState

logger = logging.getLogger("tokenloom.server")

# Seconds before a request answered "not now" (503, engine down) is sent again.
RETRY_DELAY_S = 1.0
# Batches the web page lists (the newest).
SUMMARY_BATCHES = 10


def _not_now(answer: HandlerAnswer) -> bool:
    """An answer about the server's state, not the request: it gets no result and is tried again."""
    error = answer.body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return answer.status_code == 503 or code in ("engine_dead", "shutting_down")


class BatchRunner:
    def __init__(self, store: BatchStore, caller: EndpointCaller, settings: BatchSettings,
                 state: ServerState) -> None:
        self.store = store
        self.caller = caller
        self.settings = settings
        self.state = state
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancel_events: dict[str, asyncio.Event] = {}
        self._slots: asyncio.Semaphore | None = None
        self._resumed = False

    # ------------------------------------------------------------------ control

    def resume(self) -> None:
        """Start every batch a previous server left unfinished (once; needs a running event loop)."""
        if self._resumed:
            return
        self._resumed = True
        if not self.store.claim():
            logger.warning("another server holds the batch store %s: it resumes the unfinished batches there",
                           self.store.directory)
            return
        for batch in self.store.active_batches():
            logger.info("resuming batch %s (%s)", batch.id, batch.status)
            self.submit(batch)

    def submit(self, batch: BatchRecord) -> None:
        self.cancel_events[batch.id] = asyncio.Event()
        self.tasks[batch.id] = asyncio.ensure_future(self._run(batch))
        self.tasks[batch.id].add_done_callback(lambda _: self._forget(batch.id))

    def _forget(self, batch_id: str) -> None:
        self.tasks.pop(batch_id, None)
        self.cancel_events.pop(batch_id, None)

    def cancel(self, batch: BatchRecord) -> BatchRecord:
        """Mark the batch cancelling and stop its requests; its task finalizes it as cancelled."""
        batch.status = CANCELLING
        batch.cancelling_at = int(time.time())
        self.store.save_batch(batch)
        event = self.cancel_events.get(batch.id)
        if event is not None:
            event.set()
        else:  # no task (a server that has not resumed it yet): the next run finalizes it
            self.submit(batch)
        return batch

    def summary(self) -> list[JsonObject]:
        """The newest batches and their progress, for the web page."""
        out: list[JsonObject] = []
        for batch in self.store.list_batches(limit=SUMMARY_BATCHES):
            completed, failed = self.store.result_counts(batch.id)
            out.append({"id": batch.id, "status": batch.status, "endpoint": batch.endpoint,
                        "completed": completed, "failed": failed, "total": batch.total,
                        "created_at": batch.created_at})
        return out

    # ------------------------------------------------------------------ one batch

    async def _run(self, batch: BatchRecord) -> None:
        cancelled = self.cancel_events[batch.id]
        if batch.status == CANCELLING:
            cancelled.set()
        try:
            content = self.store.file_content(batch.input_file_id)
            if content is None:
                return self._fail(batch, "input_file_missing", f"the input file {batch.input_file_id} was deleted")
            items = await asyncio.to_thread(parse_lines, split_lines(content), urls=set(self.caller.endpoints),
                                            max_line_bytes=self.settings.max_line_bytes, endpoint=batch.endpoint)
            if batch.status not in (CANCELLING, IN_PROGRESS):
                batch.status = IN_PROGRESS
                batch.in_progress_at = batch.in_progress_at or int(time.time())
            batch.total = len(items)
            self.store.save_batch(batch)
            done = self.store.done_indexes(batch.id)
            for item in items:
                if isinstance(item, LineError) and item.index not in done:
                    self.store.record_result(batch.id, item.index, False, dumps(error_line(item)))
            pending = iter([x for x in items if isinstance(x, BatchLine) and x.index not in done])
            workers = min(self.settings.concurrency, batch.total) or 1
            await asyncio.gather(*(self._worker(batch, pending, cancelled) for _ in range(workers)))
            if self.state.draining and not cancelled.is_set():
                return  # the server stops: the next one resumes this batch
            self._finalize(batch, cancelled=cancelled.is_set())
        except asyncio.CancelledError:
            raise  # the server stops
        except Exception as e:  # noqa: BLE001 - the batch fails; the server goes on
            logger.exception("batch %s failed", batch.id)
            self._fail(batch, "internal_error", f"{type(e).__name__}: {e}")

    async def _worker(self, batch: BatchRecord, pending: Iterator[BatchLine], cancelled: asyncio.Event) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.concurrency)
        for line in pending:
            while not cancelled.is_set() and not self.state.draining:
                async with self._slots:
                    answer = await self.caller.call(line.url, line.body, priority=BATCH_PRIORITY,
                                                    cancelled=cancelled)
                if answer.status_code == CANCELLED_STATUS:
                    return
                if not _not_now(answer):
                    output = answer_line(line, answer)
                    self.store.record_result(batch.id, line.index, line_succeeded(output), dumps(output))
                    break
                await asyncio.sleep(RETRY_DELAY_S)
            if cancelled.is_set() or self.state.draining:
                return

    def _finalize(self, batch: BatchRecord, cancelled: bool) -> None:
        """Write the output file (2xx answers) and the error file (the rest), in input order."""
        batch.status = FINALIZING
        batch.finalizing_at = int(time.time())
        self.store.save_batch(batch)
        good, bad = [], []
        for _, ok, line in self.store.results(batch.id):
            (good if ok else bad).append(line)
        if good:
            batch.output_file_id = self.store.add_file("batch_output", f"{batch.id}_output.jsonl",
                                                       ("\n".join(good) + "\n").encode()).id
        if bad:
            batch.error_file_id = self.store.add_file("batch_output", f"{batch.id}_error.jsonl",
                                                      ("\n".join(bad) + "\n").encode()).id
        now = int(time.time())
        if cancelled:
            batch.status, batch.cancelled_at = CANCELLED, now
        else:
            batch.status, batch.completed_at = COMPLETED, now
        self.store.save_batch(batch)
        logger.info("batch %s %s: %d succeeded, %d failed", batch.id, batch.status, len(good), len(bad))

    def _fail(self, batch: BatchRecord, code: str, message: str) -> None:
        batch.status, batch.failed_at = FAILED, int(time.time())
        batch.errors = [{"code": code, "message": message, "param": None, "line": None}]
        self.store.save_batch(batch)
