"""`tokenloom serve` as a vLLM user meets it: CORS, served-model-name aliases, dashboards' metrics, /docs.

One real server with the defaults (CORS closed, unlike vLLM's) and `--metrics-prefix vllm` (so vLLM's own
Grafana dashboards work unchanged), one with CORS opened to one origin by vLLM's flags.
"""
from __future__ import annotations

import re

import httpx
import pytest
from server_harness import ServerProcess

# Every series vLLM's Grafana dashboards query, taken from their JSON ("expr" fields):
# - vLLM, examples/observability/prometheus_grafana/grafana.json ("vLLM" dashboard)
# - vllm-project/production-stack, helm/dashboards/vllm-dashboard.json and vllm-model-metrics-dashboard.json
# (production-stack's router-only series vllm:current_qps and vllm:healthy_pods_total come from its router,
# not from an engine, and are left out).
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:generation_tokens_total",
    "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count",
    "vllm:inter_token_latency_seconds_sum", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:request_decode_time_seconds_sum",
    "vllm:request_generation_tokens_bucket", "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_prompt_tokens_bucket",
    "vllm:request_queue_time_seconds_sum", "vllm:request_success_total",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_count",
    "vllm:request_time_per_output_token_seconds_sum", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
]
# Named in the issue as read by vLLM's dashboards besides the ones above (vLLM's v1 metrics).
VLLM_REQUEST_SERIES = ["vllm:request_inference_time_seconds_sum", "vllm:request_params_n_sum",
                       "vllm:request_params_max_tokens_sum"]
# The standard collectors: prometheus-client's process collector, prometheus-fastapi-instrumentator's defaults.
PROCESS_SERIES = ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
                  "process_open_fds"]
HTTP_SERIES = ["http_requests_total", "http_request_duration_seconds_bucket", "http_request_size_bytes_sum",
               "http_response_size_bytes_sum", "http_request_duration_highr_seconds_bucket"]

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
VLLM_BUCKETS = {
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    # 1-2-5 buckets up to max_model_len (2048 in BASE_ARGS)
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}
EXPECTED_TYPES = {"vllm:e2e_request_latency_seconds": "histogram", "vllm:request_success_total": "counter",
                  "vllm:num_requests_running": "gauge", "vllm:kv_cache_usage_perc": "gauge",
                  "vllm:prompt_tokens_total": "counter", "vllm:request_prompt_tokens": "histogram",
                  "vllm:gpu_prefix_cache_hits_total": "counter",
                  "vllm:request_time_per_output_token_seconds": "histogram"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--metrics-prefix", "vllm", "--served-model-name", "main-name", "alias-name")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "alias-name", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        yield srv
    finally:
        srv.kill()


TEMPLATE = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:"


@pytest.fixture(scope="module")
def strict_cors_server():
    """Also: a chat template given inline, and sampling defaults over the generation config."""
    srv = ServerProcess("--allowed-origins", '["http://allowed.example"]', "--allowed-methods", '["GET", "POST"]',
                        "--allow-credentials", "--chat-template", TEMPLATE,
                        "--override-generation-config", '{"max_new_tokens": 3}', "--generation-config", "vllm")
    try:
        yield srv
    finally:
        srv.kill()


def _series(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "content-type, authorization"})


# ------------------------------------------------------------------ CORS

def test_by_default_a_preflight_gets_no_cors_headers(server):
    r = _preflight(server.url, "http://any.example")
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]


def test_by_default_a_cross_origin_reply_does_not_let_the_page_read_it(server):
    r = server.get("/v1/models", headers={"Origin": "http://any.example"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_allowed_origin_is_echoed_with_credentials(strict_cors_server):
    r = _preflight(strict_cors_server.url, "http://allowed.example")
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://allowed.example"
    assert r.headers["access-control-allow-credentials"] == "true"


def test_other_origin_is_refused(strict_cors_server):
    r = _preflight(strict_cors_server.url, "http://evil.example")
    assert r.status_code == 400
    assert "access-control-allow-origin" not in r.headers


def test_method_outside_allowed_methods_is_refused(strict_cors_server):
    r = _preflight(strict_cors_server.url, "http://allowed.example", method="DELETE")
    assert r.status_code == 400


# ------------------------------------------------------------------ served model names

def test_every_served_model_name_is_listed(server):
    ids = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert ids == ["main-name", "alias-name"]


def test_metrics_are_labelled_with_the_first_served_name(server):
    assert 'model_name="main-name"' in server.get("/metrics").text


# ------------------------------------------------------------------ dashboards

def test_every_dashboard_series_is_exposed_under_the_vllm_prefix(server):
    exposed = _series(server.get("/metrics").text)
    missing = [name for name in DASHBOARD_SERIES + VLLM_REQUEST_SERIES if name not in exposed]
    assert not missing, missing


def test_no_series_keeps_the_tokenloom_prefix_under_metrics_prefix_vllm(server):
    assert not [s for s in _series(server.get("/metrics").text) if s.startswith("tokenloom:")]


def test_process_and_http_families_are_exposed(server):
    exposed = _series(server.get("/metrics").text)
    missing = [name for name in PROCESS_SERIES + HTTP_SERIES if name not in exposed]
    assert not missing, missing


def test_http_requests_are_counted_by_handler(server):
    text = server.get("/metrics").text
    assert re.search(r'http_requests_total\{[^}]*handler="/v1/chat/completions"[^}]*\} [1-9]', text), text[:2000]


@pytest.mark.parametrize("name", sorted(EXPECTED_TYPES))
def test_metric_types_match_vllm(server, name):
    assert f"# TYPE {name} {EXPECTED_TYPES[name]}" in server.get("/metrics").text


@pytest.mark.parametrize("name", sorted(VLLM_BUCKETS))
def test_histogram_buckets_match_vllm(server, name):
    text = server.get("/metrics").text
    bounds = [float(b) for b in re.findall(re.escape(name) + r'_bucket\{le="([^"+]+)"', text)]
    assert bounds == [float(b) for b in VLLM_BUCKETS[name]]


def test_request_histograms_count_the_finished_request(server):
    text = server.get("/metrics").text
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_params_n_count",
                 "vllm:request_params_max_tokens_count", "vllm:request_inference_time_seconds_count"):
        value = re.search(re.escape(name) + r"\{[^}]*\} (\S+)", text)
        assert value and float(value.group(1)) >= 1, name


# ------------------------------------------------------------------ /docs

def test_docs_page_loads_its_assets_from_this_server(server):
    html = server.get("/docs").text
    assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', html)
    assert assets
    assert not [a for a in assets if a.startswith(("http://", "https://", "//"))], assets
    for asset in assets:
        r = server.get(asset)
        assert r.status_code == 200 and len(r.content) > 1000, asset


def test_redoc_page_loads_its_script_from_this_server(server):
    html = server.get("/redoc").text
    scripts = re.findall(r'src="([^"]+)"', html)
    assert scripts and all(s.startswith("/") and not s.startswith("//") for s in scripts), scripts
    assert server.get(scripts[0]).status_code == 200


# ------------------------------------------------------------------ vLLM server flags

def test_chat_template_flag_replaces_the_models_template(strict_cors_server):
    srv = strict_cors_server
    ids = srv.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()["tokens"]
    assert srv.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Q: hello\nA:"


def test_override_generation_config_sets_the_default_max_tokens(strict_cors_server):
    r = strict_cors_server.post("/v1/chat/completions", json={
        "model": strict_cors_server.model, "messages": [{"role": "user", "content": "Count to twenty."}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"
