"""Per-request state in the API process: the stream a `generate()` waits on, and the request's timings.

The engine's outputs arrive on one task (`AsyncLLM._on_outputs`); each request's consumer waits on its own
`RequestStream`, which holds only the latest cumulative `RequestOutput` (a slow consumer skips intermediate
ones, never falls behind). `OpenRequests` is the set of them, with the sums admission reads.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenloom.core.messages import EngineCoreOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.load_estimator import PROMPT_TOKEN_WEIGHT
from tokenloom.outputs import RequestOutput

# The engine's timestamps a stream keeps: the first of each (a request's n sequences report them apart), and
# the last finish.
_FIRST_TIMES = ("arrival_time", "first_scheduled_time", "first_token_time")


@dataclass
class StageLatencies:
    """Seconds a finished request spent queued, prefilling and decoding (None: the engine did not say)."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None


@dataclass
class RequestStream:
    """One open request: what its consumer waits on, and its timings."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    params: SamplingParams | None = None  # what it was asked (for the tracing span)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    engine_times: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    num_seqs: int = 1  # sequences it runs in the engine (n / best_of)
    max_tokens: int = 0  # per sequence (for the queued-work estimate)
    generated: int = 0  # tokens generated so far, all sequences together

    @property
    def remaining_work(self) -> float:
        """Decode-equivalent tokens this request still needs from the engine (see LoadEstimator)."""
        prompt = 0 if self.first_token is not None else self.num_prompt_tokens * PROMPT_TOKEN_WEIGHT
        return prompt + max(0, self.num_seqs * self.max_tokens - self.generated)

    @property
    def stage(self) -> str:
        """queued | prefill | decoding (for the web page's rows)."""
        if self.first_token is not None:
            return "decoding"
        return "prefill" if "first_scheduled_time" in self.engine_times else "queued"

    def put(self, out: RequestOutput) -> None:
        self.latest = out
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        out, self.latest = self.latest, None
        assert out is not None
        return out

    def observe(self, o: EngineCoreOutput, now: float) -> float | None:
        """Take one engine output's tokens and timestamps; returns the gap since this sequence's previous token
        (None for a first token or no token)."""
        gap = None
        if o.new_token_ids:
            self.generated += len(o.new_token_ids)
            last = self.last_token.get(o.index)
            if self.first_token is None:
                self.first_token = now
            elif last is not None:
                gap = now - last
            self.last_token[o.index] = now
        for key in (*_FIRST_TIMES, "finished_time"):
            value = getattr(o, key)
            if value:
                if key in _FIRST_TIMES:
                    self.engine_times.setdefault(key, value)
                else:
                    self.engine_times[key] = value
        return gap

    def stage_latencies(self) -> StageLatencies:
        t = self.engine_times
        out = StageLatencies()
        if t.get("first_scheduled_time") and t.get("arrival_time"):
            out.queue = t["first_scheduled_time"] - t["arrival_time"]
        if t.get("first_token_time") and t.get("first_scheduled_time"):
            out.prefill = t["first_token_time"] - t["first_scheduled_time"]
        if t.get("finished_time") and t.get("first_token_time"):
            out.decode = t["finished_time"] - t["first_token_time"]
        return out

    def timeout_message(self, timeout: float) -> str:
        if self.first_token is None:
            return (f"request timed out after {timeout:g} s before its first token (queued or prefilling); "
                    f"the server is busy, retry later or raise the timeout")
        return f"request timed out after {timeout:g} s while generating"


class OpenRequests(dict[str, RequestStream]):
    """The open requests by id, with the sums admission and the web page read."""

    @property
    def num_seqs(self) -> int:
        return sum(s.num_seqs for s in self.values())

    @property
    def remaining_work(self) -> float:
        return sum(s.remaining_work for s in self.values())

    def fail_all(self, exc: BaseException) -> None:
        for stream in list(self.values()):
            stream.fail(exc)

    def oldest_first(self) -> list[RequestStream]:
        return sorted(self.values(), key=lambda s: s.arrival)
