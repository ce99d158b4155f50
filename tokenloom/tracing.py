"""OpenTelemetry request spans (``tokenloom serve --otlp-traces-endpoint URL``), off by default.

One SERVER span per finished request, named ``llm_request`` with vLLM's attribute names
(``gen_ai.*``), created when the request ends with its start set to the arrival time, so
nothing is kept or computed per request while it runs. When the flag is not given, the
OpenTelemetry SDK and exporters are never imported (nor needed): tracing costs nothing when off.
A request that fails (engine error, timeout, abort) gets an error status.

Install: ``pip install opentelemetry-sdk opentelemetry-exporter-otlp`` (or the ``tracing``
extra). Tests use the SDK's in-memory exporter through `init_tracer(exporter=...)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, Union

from tokenloom.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing.py; the gen_ai semantic conventions where they exist)."""

    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # Not in vLLM: why the request ended (stop, length, abort, error, timeout).
    GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reasons"


# An OpenTelemetry attribute's value.
AttributeValue = Union[str, bool, int, float, Sequence[str]]


class Span(Protocol):
    def set_status(self, status: object) -> None: ...
    def end(self, end_time: int | None = None) -> None: ...


class SpanTracer(Protocol):
    """What this module needs of an OpenTelemetry tracer (opentelemetry.trace.Tracer has it)."""

    def start_span(self, name: str, *, kind: object, attributes: dict[str, AttributeValue],
                   start_time: int) -> Span: ...


class TracingUnavailableError(RuntimeError):
    """--otlp-traces-endpoint was given but the OpenTelemetry packages are not installed."""


def init_tracer(name: str, endpoint: str | None = None, exporter: SpanExporter | None = None) -> SpanTracer:
    """A tracer exporting to the OTLP `endpoint` (gRPC, or HTTP when the URL ends in /v1/traces), or to
    `exporter` (tests: the SDK's InMemorySpanExporter, exported synchronously)."""
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as e:
        raise TracingUnavailableError("tracing needs the OpenTelemetry SDK: pip install opentelemetry-sdk "
                                      f"opentelemetry-exporter-otlp ({e})") from None
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            if endpoint and endpoint.rstrip("/").endswith("/v1/traces"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise TracingUnavailableError("tracing needs an OTLP exporter: pip install "
                                          f"opentelemetry-exporter-otlp ({e})") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer(name)


def record_request_span(tracer: SpanTracer, *, request_id: str, model: str | None, arrival: float, end: float,
                        params: SamplingParams | None, prompt_tokens: int, completion_tokens: int, finish_reason: str,
                        queue: float | None = None, ttft: float | None = None, prefill: float | None = None,
                        decode: float | None = None, error: str | None = None) -> None:
    """Emit one finished request's span (times in seconds since the epoch / in seconds)."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    a = SpanAttributes
    attrs: dict[str, AttributeValue] = {
        a.GEN_AI_REQUEST_ID: request_id,
        a.GEN_AI_USAGE_PROMPT_TOKENS: int(prompt_tokens),
        a.GEN_AI_USAGE_COMPLETION_TOKENS: int(completion_tokens),
        a.GEN_AI_LATENCY_E2E: max(0.0, end - arrival),
        a.GEN_AI_RESPONSE_FINISH_REASON: (finish_reason,),
    }
    if model:
        attrs[a.GEN_AI_RESPONSE_MODEL] = model
    if params is not None:
        for key, field in ((a.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (a.GEN_AI_REQUEST_TOP_P, "top_p"),
                           (a.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"), (a.GEN_AI_REQUEST_N, "n")):
            value = getattr(params, field, None)
            if value is not None:
                attrs[key] = value
        attrs[a.GEN_AI_USAGE_NUM_SEQUENCES] = max(getattr(params, "n", 1) or 1, getattr(params, "best_of", 0) or 0)
    for key, value in ((a.GEN_AI_LATENCY_TIME_IN_QUEUE, queue), (a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, ttft),
                       (a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, prefill),
                       (a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, decode)):
        if value is not None:
            attrs[key] = max(0.0, float(value))
    if prefill is not None and decode is not None:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, prefill + decode)
    span = tracer.start_span(SPAN_NAME, kind=SpanKind.SERVER, attributes=attrs, start_time=int(arrival * 1e9))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=int(end * 1e9))
