"""The request log (``--log-requests``): one line per request event, as much as the level asks for.

Levels: off, lifecycle (received / finished), stages (+ first token and the queue / prefill / decode times),
full (+ prompt and output text).
"""
from __future__ import annotations

import logging

from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.streams import StageLatencies
from tokenloom.outputs import RequestOutput

logger = logging.getLogger("tokenloom.requests")

LOG_LEVELS = ("off", "lifecycle", "stages", "full")


class RequestLog:
    def __init__(self, level: str = "off") -> None:
        if level not in LOG_LEVELS:
            raise ValueError(f"log_requests must be one of {', '.join(LOG_LEVELS)}")
        self.level = level

    @property
    def stages(self) -> bool:
        return self.level in ("stages", "full")

    def received(self, req: EngineCoreRequest, params: SamplingParams, prompt_text: str | None) -> None:
        if self.level == "off":
            return
        msg = (f"request {req.request_id} received: {len(req.prompt_token_ids)} prompt tokens, n={params.n}, "
               f"max_tokens={params.max_tokens}, temperature={params.temperature}")
        if self.level == "full":
            msg += f", prompt={prompt_text if prompt_text is not None else req.prompt_token_ids!r}"
            msg += f", params={params!r}"
        logger.info(msg)

    def first_token(self, request_id: str, seconds: float) -> None:
        if self.stages:
            logger.info("request %s first token after %.3f s", request_id, seconds)

    def finished(self, ro: RequestOutput, reason: str | None, generated: int, seconds: float,
                 stages: StageLatencies) -> None:
        if self.level == "off":
            return
        msg = (f"request {ro.request_id} finished ({reason}): {len(ro.prompt_token_ids)} prompt + "
               f"{generated} generated tokens in {seconds:.3f} s")
        if self.stages:
            fmt = lambda v: "-" if v is None else f"{v:.3f} s"  # noqa: E731
            msg += f"; queued {fmt(stages.queue)}, prefill {fmt(stages.prefill)}, decode {fmt(stages.decode)}"
        if self.level == "full":
            msg += f"; output: {[o.text for o in ro.outputs]!r}"
        logger.info(msg)

    def ended(self, request_id: str, reason: str, seconds: float) -> None:
        """A request that did not finish: timed out (always logged) or aborted."""
        if reason == "timeout":
            logger.warning("request %s timed out after %.3f s", request_id, seconds)
        elif self.level != "off":
            logger.info("request %s aborted after %.3f s", request_id, seconds)

    @staticmethod
    def failed(request_id: str, error: str) -> None:
        logger.warning("request %s failed in the engine: %s", request_id, error)
