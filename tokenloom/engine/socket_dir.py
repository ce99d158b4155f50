"""The folder of the API process's ZMQ sockets to its engine: ``$TMPDIR/tokenloom-<pid>-XXXXXXXX/``.

The process removes it when it stops; a process that is killed (SIGKILL, OOM) cannot, so each start first
removes the folders whose owner process is gone. The owner's pid is in the name; a folder is removed only
when it belongs to this user and no process of that pid exists (a pid now used by another process keeps
its folder: left, never wrongly removed).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

logger = logging.getLogger("tokenloom.engine")

PREFIX = "tokenloom-"
_OWNED = re.compile(r"tokenloom-(\d+)-[A-Za-z0-9_]+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_socket_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's socket folders whose owner process is gone; returns their paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _OWNED.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        logger.info("removed %d socket folder(s) left by stopped tokenloom processes", len(removed))
    return removed


def make_socket_dir() -> str:
    """A new socket folder named after this process, after removing stale ones."""
    remove_stale_socket_dirs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
