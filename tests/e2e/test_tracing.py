"""OpenTelemetry request spans on the real engine (AsyncLLM + its engine process, the
embedded model), exported to the SDK's in-memory exporter: one `llm_request` SERVER span per request with
vLLM's attribute names, the queue / prefill / decode / first-token latencies and token counts."""
from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.request_errors import RequestTimeoutError
from tokenloom.tracing import SPAN_NAME, init_tracer
from tokenloom.tracing import SpanAttributes as A


@pytest.fixture(scope="module")
def traced():
    """(engine, exporter, loop): an AsyncLLM with tracing into memory."""
    from tokenloom.config import EngineConfig

    config = EngineConfig.from_kwargs(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                                      num_blocks=64, max_model_len=256, log_stats_interval=0)
    loop = asyncio.new_event_loop()
    engine = AsyncLLM(config, served_model_name="traced-model")
    loop.run_until_complete(engine.start())
    exporter = InMemorySpanExporter()
    engine.tracer = init_tracer("tokenloom-test", exporter=exporter)
    yield engine, exporter, loop
    engine.shutdown()
    loop.close()


def _run(loop, engine, request_id, params, timeout=None):
    async def go():
        final = None
        async for out in engine.generate("The sky is", params, request_id, timeout=timeout):
            final = out
        return final

    return loop.run_until_complete(go())


def test_one_span_per_request_with_vllm_attributes(traced):
    engine, exporter, loop = traced
    exporter.clear()
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=5, n=2, ignore_eos=True)
    out = _run(loop, engine, "traced-1", params)
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_NAME and span.kind == SpanKind.SERVER
    a = span.attributes
    assert a[A.GEN_AI_REQUEST_ID] == "traced-1" and a[A.GEN_AI_RESPONSE_MODEL] == "traced-model"
    assert a[A.GEN_AI_USAGE_PROMPT_TOKENS] == len(out.prompt_token_ids)
    assert a[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 10  # 2 sequences x 5 tokens
    assert (a[A.GEN_AI_REQUEST_N], a[A.GEN_AI_REQUEST_MAX_TOKENS]) == (2, 5)
    assert a[A.GEN_AI_REQUEST_TEMPERATURE] == 0.5 and a[A.GEN_AI_REQUEST_TOP_P] == 0.9
    for key in (A.GEN_AI_LATENCY_TIME_IN_QUEUE, A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
                A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE):
        assert a[key] >= 0, key
    e2e = a[A.GEN_AI_LATENCY_E2E]
    assert a[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= e2e
    assert abs((span.end_time - span.start_time) / 1e9 - e2e) < 1e-3  # the span covers arrival to the end
    assert a[A.GEN_AI_RESPONSE_FINISH_REASON] == ("length",)
    assert span.status.status_code != StatusCode.ERROR


def test_a_request_that_times_out_gets_an_error_span(traced):
    engine, exporter, loop = traced
    exporter.clear()
    with pytest.raises(RequestTimeoutError):
        _run(loop, engine, "traced-2", SamplingParams(max_tokens=200, ignore_eos=True), timeout=0.3)
    loop.run_until_complete(asyncio.sleep(0.2))
    (span,) = exporter.get_finished_spans()
    assert span.attributes[A.GEN_AI_REQUEST_ID] == "traced-2"
    assert span.attributes[A.GEN_AI_RESPONSE_FINISH_REASON] == ("timeout",)
    assert span.status.status_code == StatusCode.ERROR


def test_no_spans_without_a_tracer(traced):
    engine, exporter, loop = traced
    exporter.clear()
    tracer, engine.tracer = engine.tracer, None
    try:
        _run(loop, engine, "untraced", SamplingParams(max_tokens=2))
    finally:
        engine.tracer = tracer
    assert exporter.get_finished_spans() == ()
