"""Helpers every process of the engine uses: the EngineCore process and the worker processes."""
from __future__ import annotations

import ctypes
import signal
import sys


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass
