"""What the API process records of each request's life: Prometheus metrics, the tracing span, the request log.

`AsyncLLM` reports the events (arrived, first token, token gap, finished, ended early, failed); this one place
turns each into the metrics.py observations, one OpenTelemetry span per ended request (tracing.py, when a
tracer is set) and the request log's lines, so the streaming code knows none of them.
"""
from __future__ import annotations

import logging

from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.request_log import RequestLog
from tokenloom.engine.streams import RequestStream, StageLatencies
from tokenloom.metrics import ServerMetrics
from tokenloom.outputs import RequestOutput
from tokenloom.tracing import SpanTracer, record_request_span

logger = logging.getLogger("tokenloom.requests")


class RequestEvents:
    def __init__(self, log: RequestLog) -> None:
        self.log = log
        self.metrics: ServerMetrics | None = None  # set once the engine is up (AsyncLLM.start)
        self.tracer: SpanTracer | None = None  # set with --otlp-traces-endpoint (tracing.py)
        self.model_name: str | None = None
        self.mean_latency = 1.0  # moving average of finished requests' e2e seconds (for Retry-After)

    def arrived(self, req: EngineCoreRequest, params: SamplingParams, prompt_text: str | None) -> None:
        if self.metrics is not None:
            self.metrics.observe_request_params(n=params.n, max_tokens=params.max_tokens)
        self.log.received(req, params, prompt_text)

    def first_token(self, stream: RequestStream, now: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_first_token(now - stream.arrival)
        self.log.first_token(stream.request_id, now - stream.arrival)

    def token_gap(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_inter_token(seconds)

    def finished(self, stream: RequestStream, ro: RequestOutput, now: float) -> None:
        gen = sum(len(o.token_ids) for o in ro.outputs)
        reason = ro.outputs[0].finish_reason if ro.outputs else "error"
        self.mean_latency = 0.9 * self.mean_latency + 0.1 * max(0.0, now - stream.arrival)
        stages = stream.stage_latencies()
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason=reason or "stop", prompt_tokens=len(ro.prompt_token_ids),
                                          generation_tokens=gen, e2e=now - stream.arrival, queue=stages.queue,
                                          prefill=stages.prefill, decode=stages.decode,
                                          max_generation_tokens=max((len(o.token_ids) for o in ro.outputs),
                                                                    default=0))
        self._trace(stream, now, reason or "stop", len(ro.prompt_token_ids), gen, stages=stages)
        self.log.finished(ro, reason, gen, now - stream.arrival, stages)

    def ended(self, stream: RequestStream, reason: str, generated: int, now: float) -> None:
        """It ended before finishing: "abort" (the client left), "timeout" or "error" (the engine died)."""
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason=reason, prompt_tokens=stream.num_prompt_tokens,
                                          generation_tokens=generated, e2e=now - stream.arrival)
        self._trace(stream, now, reason, stream.num_prompt_tokens, generated,
                    error=None if reason == "abort" else f"request ended: {reason}")
        self.log.ended(stream.request_id, reason, now - stream.arrival)

    def failed(self, stream: RequestStream, error: str, now: float) -> None:
        """The engine failed it (the others go on)."""
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason="error", prompt_tokens=stream.num_prompt_tokens,
                                          generation_tokens=0, e2e=now - stream.arrival)
        self._trace(stream, now, "error", stream.num_prompt_tokens, stream.generated, error=error)
        self.log.failed(stream.request_id, error)

    def _trace(self, stream: RequestStream, end: float, reason: str, prompt_tokens: int, generated: int,
               error: str | None = None, stages: StageLatencies | None = None) -> None:
        """One span per ended request when tracing is on (see tracing.py); nothing otherwise."""
        if self.tracer is None:
            return
        stages = stages or StageLatencies()
        try:
            record_request_span(self.tracer, request_id=stream.request_id, model=self.model_name,
                                arrival=stream.arrival, end=end, params=stream.params,
                                prompt_tokens=prompt_tokens, completion_tokens=generated, finish_reason=reason,
                                ttft=None if stream.first_token is None else stream.first_token - stream.arrival,
                                error=error, queue=stages.queue, prefill=stages.prefill, decode=stages.decode)
        except Exception:  # noqa: BLE001 - tracing never fails a request
            logger.exception("recording the trace span failed")
