"""How often a dead engine (or data-parallel replica) may be restarted.

An engine that dies again and again right after (re)starting (a bad device, a model that crashes on load) must
end the server, not loop: at most MAX_RESTARTS_IN_WINDOW restarts within RESTART_WINDOW_S, every attempt
counted (a start-up that dies included), all replicas together.
"""
from __future__ import annotations

import time
from typing import Callable

from tokenloom.engine.core_client import EngineStartupError

MAX_RESTARTS_IN_WINDOW = 3
RESTART_WINDOW_S = 120.0


class RestartPolicy:
    def __init__(self, max_restarts: int = MAX_RESTARTS_IN_WINDOW, window_s: float = RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.attempts: list[float] = []
        self.num_restarts = 0  # restarts that succeeded

    def count_attempt(self, subject: str, refusal: str) -> None:
        """Count one restart attempt, or raise EngineStartupError when the window's budget is spent: the message
        reads "<subject> restarted N times within W s and <refusal>"."""
        now = self.clock()
        self.attempts = [t for t in self.attempts if now - t < self.window_s]
        if len(self.attempts) >= self.max_restarts:
            raise EngineStartupError(f"{subject} restarted {len(self.attempts)} times within {self.window_s:g} s "
                                     f"and {refusal}")
        self.attempts.append(now)

    def succeeded(self) -> None:
        self.num_restarts += 1
