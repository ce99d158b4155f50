"""The on-disk store of files, batches and each batch request's result (SQLite, from the standard library).

Why a database and not JSONL files: a result is written the moment its request finishes, in its own small
transaction, so a server stopped mid-batch (SIGTERM, a crash, a kill) loses no finished result, and
the next server finds each unfinished batch (`active_batches`) and the lines it still owes
(`done_indexes`). A result is keyed by (batch, line): written once, whatever happens around it.

Several servers may share one store (the default folder is per user); only the one holding the store's
lock file (`claim`) resumes unfinished batches, so no batch runs twice. One connection, guarded by a lock:
the server calls it from its event loop, tests from other threads.
Calls are short (one row); file contents are stored whole, bounded by the upload limit.
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
from pathlib import Path

from tokenloom.entrypoints.openai.batch.objects import ACTIVE_STATUSES, BatchRecord, FileRecord, new_file_id

DB_NAME = "batches.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_index));
"""


class BatchStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / DB_NAME
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")  # a result is one small append, durable once committed
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock_fd: int | None = None

    def claim(self) -> bool:
        """Take the store's lock for this process (released when it exits); False if another holds it."""
        if self._lock_fd is not None:
            return True
        fd = os.open(self.directory / "store.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _run(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ files

    def add_file(self, purpose: str, filename: str, content: bytes) -> FileRecord:
        record = FileRecord(new_file_id(), purpose, filename, len(content))
        self._run("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                  (record.id, purpose, filename, record.bytes, record.created_at, content))
        return record

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self._run("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (file_id,))
        return FileRecord(*rows[0]) if rows else None

    def file_content(self, file_id: str) -> bytes | None:
        rows = self._run("SELECT content FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    def list_files(self, purpose: str | None = None, limit: int = 10000, after: str | None = None) -> list[FileRecord]:
        """Newest first; `after` is the id of the last file of the previous page."""
        rows = self._run("SELECT id, purpose, filename, bytes, created_at FROM files "
                         "WHERE (? IS NULL OR purpose = ?) ORDER BY created_at DESC, rowid DESC", (purpose, purpose))
        files = [FileRecord(*row) for row in rows]
        if after is not None:
            ids = [f.id for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        return files[:limit]

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # ------------------------------------------------------------------ batches

    def save_batch(self, batch: BatchRecord) -> None:
        """Insert or update the batch's record."""
        self._run("INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?)",
                  (batch.id, batch.status, batch.created_at, json.dumps(batch.to_json())))

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = self._run("SELECT data FROM batches WHERE id = ?", (batch_id,))
        return BatchRecord.from_json(json.loads(rows[0][0])) if rows else None

    def list_batches(self, limit: int = 10000, after: str | None = None) -> list[BatchRecord]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        if after is None:  # the common case (and the web page's, every second): only the rows asked for
            rows = self._run("SELECT data FROM batches ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,))
            return [BatchRecord.from_json(json.loads(r[0])) for r in rows]
        rows = self._run("SELECT data FROM batches ORDER BY created_at DESC, rowid DESC")
        batches = [BatchRecord.from_json(json.loads(r[0])) for r in rows]
        if after is not None:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        return batches[:limit]

    def active_batches(self) -> list[BatchRecord]:
        """Batches a stopped server left unfinished, oldest first: the next one resumes them."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self._run(f"SELECT data FROM batches WHERE status IN ({marks}) ORDER BY created_at, rowid",
                         ACTIVE_STATUSES)
        return [BatchRecord.from_json(json.loads(r[0])) for r in rows]

    # ------------------------------------------------------------------ results

    def record_result(self, batch_id: str, line_index: int, ok: bool, line: str) -> bool:
        """Keep one line's output; False when that line already has one (it is kept, not replaced)."""
        with self._lock:
            cursor = self._db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                                      (batch_id, line_index, int(ok), line))
            return cursor.rowcount > 0

    def done_indexes(self, batch_id: str) -> set[int]:
        return {r[0] for r in self._run("SELECT line_index FROM results WHERE batch_id = ?", (batch_id,))}

    def result_counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) so far."""
        rows = self._run("SELECT ok, COUNT(*) FROM results WHERE batch_id = ? GROUP BY ok", (batch_id,))
        counts = dict(rows)
        return counts.get(1, 0), counts.get(0, 0)

    def results(self, batch_id: str) -> list[tuple[int, bool, str]]:
        """(line index, succeeded, output line) in input order."""
        rows = self._run("SELECT line_index, ok, line FROM results WHERE batch_id = ? ORDER BY line_index",
                         (batch_id,))
        return [(i, bool(ok), line) for i, ok, line in rows]
