"""Reliability of the real server: admission control, timeouts, hostile input, one request's engine
fault, API key everywhere, and (last, since they kill the engine) a dead and a hung engine being
restarted. One server for the module, on the embedded model, with test-only fault injection on.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from server_harness import ServerProcess, metric_values, stream_in_thread, wait_idle

API_KEY = "rel-key"
H = {"Authorization": f"Bearer {API_KEY}"}
ERROR_TOKEN, HANG_TOKEN = 48999, 48998  # a prompt starting with these trips the injected faults
MAX_NUM_SEQS, MAX_WAITING = 4, 4
BODY_LIMIT = 1_000_000
STEP_TIMEOUT = 8  # generous: the test machine's 2 cores are shared, and a step must never be mistaken for hung
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", API_KEY, "--restart-engine", "--engine-step-timeout", str(STEP_TIMEOUT),
                        "--trust-request-chat-template",
                        "--engine-heartbeat-timeout", "8", "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-waiting-requests", str(MAX_WAITING), "--max-request-body-bytes", str(BODY_LIMIT),
                        env={"TOKENLOOM_FAULTS": f"step_error={ERROR_TOKEN},step_hang={HANG_TOKEN}"})
    try:
        yield srv
    finally:
        code = srv.terminate()
        assert code == 0, srv.log_text()


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, headers=H, timeout=kw.pop("timeout", 120), **kw)


def metrics(srv) -> dict[str, float]:
    return metric_values(httpx.get(srv.url + "/metrics", headers=H, timeout=30).text)


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_serves(srv) -> None:
    r = post(srv, "/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- API key

def test_api_key_on_every_endpoint_but_health(server):
    schema = httpx.get(server.url + "/openapi.json", headers=H, timeout=30).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs")]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/health") in routes
    for method, path in routes:
        url = server.url + path.replace("{model_id}", "x")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"}):
            r = httpx.request(method, url, headers=headers, json={} if method == "POST" else None, timeout=30)
            if path == "/health":
                assert r.status_code in (200, 503), (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                if method == "HEAD":  # the status alone: a HEAD answer has no body
                    assert r.content == b""
                elif path.startswith("/v1/messages"):  # Anthropic's error shape
                    assert r.json()["error"]["type"] == "authentication_error"
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- hostile input

_DEEP = {"prompt": "hi", "chat_template_kwargs": {"x": json.loads("[" * 100 + "]" * 100)}}
_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                            for i in range(1000)}}


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/chat/completions", {"messages": CHAT * 2049}, 400, "messages", None),
    ("/v1/completions", {"prompt": "word " * 140_000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi " * 3000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 2000}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 30}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, None, None),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 300]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "bad_words": [f"w{i}" for i in range(129)]}, 400, "bad_words", None),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _SCHEMA}}}, 400, "response_format", "request_too_large"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(a{1000}){1000}"}}, 400,
     "structured_outputs.regex", "regex_too_complex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "((a+)+)+b"}}, 400,
     "structured_outputs.regex", "regex_too_complex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs.regex", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "r ::= 'a'\n" * 10_000}}, 400,
     "structured_outputs.grammar", "request_too_large"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["a"] * 2000}}, 400,
     "structured_outputs.choice", "request_too_large"),
    ("/v1/completions", _DEEP, 400, None, "nesting_too_deep"),
    ("/v1/completions", {"prompt": "x" * (BODY_LIMIT + 1)}, 413, None, "request_too_large"),
    ("/v1/completions", {"prompt": "hi", "timeout": -1}, 400, "timeout", None),
])
def test_limits_give_clear_4xx(server, path, body, status, param, code):
    t0 = time.time()
    r = post(server, path, body)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert time.time() - t0 < 10


_CANARY = "/tmp/tokenloom-template-canary"
MALICIOUS_TEMPLATES = [
    "{{ cycler.__init__.__globals__.os.popen('touch " + _CANARY + "').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch " + _CANARY + "') }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ dict.__call__.__globals__['os'] }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch " + _CANARY + "') }}",
    "{% import 'os' as os %}{{ os }}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{{ (messages|first).__class__.__init__.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{% set x = namespace() %}{% set x.__class__ = 1 %}{{ x }}",
    "{{ messages.append(1) }}{{ messages.pop() }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}x"
    "{% endfor %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 100000 * 100000 }}",
    "{{ 2 ** 100000000 }}",
    "{{ (('x' * 10000) ~ ('y' * 10000)) * 10000000 }}",
]


@pytest.mark.parametrize("template", MALICIOUS_TEMPLATES)
def test_malicious_chat_template_is_rejected(server, template):
    t0 = time.time()
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "chat_template": template},
             timeout=60)
    assert r.status_code == 400, (template, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == "chat_template"
    assert "root:" not in r.text and "uid=" not in r.text
    assert not os.path.exists(_CANARY)
    assert time.time() - t0 < 15, "template ran too long"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


FREEZERS = [  # D1: each froze the API process (GIL-holding C work) or grew it by hundreds of MB
    "{% set a = (7**1024)**1024 %}{% set b = a**16 %}x",
    "{% set ns = namespace(a=7) %}{% for i in range(64) %}{% set ns.a = ns.a * ns.a %}{% endfor %}x",
    "{{ '%300000000s' % 'a' }}",
    "{{ 'a'.center(300000000) }}",
    "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}x",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
]


# /health answers in milliseconds; rendered in the API process, these templates held its GIL for up to 30 s
# (measured before renders got their own process). 5 s leaves a loaded machine its scheduling delays and
# stays far below such a stall.
HEALTH_WHILE_RENDERING = 5.0


@pytest.mark.parametrize("template", FREEZERS)
def test_request_template_cannot_stall_other_requests(server, template):
    """While a hostile request template renders (in its limited process), /health answers at once."""
    result = {}

    def send():
        result["r"] = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                            "chat_template": template}, timeout=60)

    import threading
    t0 = time.time()
    th = threading.Thread(target=send)
    th.start()
    worst = 0.0
    while th.is_alive():
        h0 = time.time()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.time() - h0)
        time.sleep(0.05)
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text[:300]
    assert time.time() - t0 < 10
    assert worst < HEALTH_WHILE_RENDERING, f"/health waited {worst:.2f} s"


# ---------------------------------------------------------------- admission control and timeouts

def test_overload_gets_503_with_retry_after_at_once(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=H, timeout=120) as c:
            body = {"prompt": "Count to a hundred:", "max_tokens": 16, "ignore_eos": True, "temperature": 0}

            async def one(i):
                t0 = time.time()
                r = await c.post("/v1/completions", json={**body, "stream": i % 2 == 0})
                return r, time.time() - t0

            return await asyncio.gather(*[one(i) for i in range(16)])

    results = asyncio.run(main())
    ok = [r for r, _ in results if r.status_code == 200]
    rejected = [(r, dt) for r, dt in results if r.status_code == 503]
    assert len(ok) + len(rejected) == len(results), [r.status_code for r, _ in results]
    assert len(ok) <= MAX_NUM_SEQS + MAX_WAITING and len(ok) >= MAX_NUM_SEQS
    assert len(rejected) >= 16 - MAX_NUM_SEQS - MAX_WAITING
    for r, dt in rejected:
        assert r.json()["error"]["code"] == "server_overloaded"
        assert int(r.headers["Retry-After"]) >= 1
        assert dt < 5, "a rejection must come at once"
    for r in ok:  # the admitted ones are served completely
        if r.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        else:
            assert r.json()["usage"]["completion_tokens"] == 16
    m = wait_idle(server, headers=H)
    assert sum(m.get(f'tokenloom:request_rejected_total{{reason="{reason}"}}', 0)
               for reason in ("queue_full", "expected_latency")) >= len(rejected)


def test_request_timeout(server):
    """An admitted request that runs past its `timeout` ends with 504. Admission refuses at once a timeout shorter
    than the expected latency unless the engine is idle, so each request starts on an idle engine."""
    before = wait_idle(server, headers=H).get('tokenloom:request_success_total{finished_reason="timeout"}', 0)
    body = {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "timeout": 1.0}
    t0 = time.time()
    r = post(server, "/v1/completions", body)
    assert 0.9 < time.time() - t0 < 10, r.text
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    wait_idle(server, headers=H)
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1500, "ignore_eos": True,
                                              "timeout": 1.0, "stream": True})
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout" and events[-2]["error"]["status_code"] == 504
    m = wait_idle(server, headers=H)
    assert m['tokenloom:request_success_total{finished_reason="timeout"}'] - before == 2
    assert_serves(server)


# ---------------------------------------------------------------- one request's engine fault

def test_request_fault_in_engine_fails_alone(server):
    """The injected fault raises inside EngineCore.step for one request while others share its batch."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=H, timeout=120) as c:
            good = [c.post("/v1/completions", json={"prompt": [1, 2, 3, 4 + i], "max_tokens": 12, "ignore_eos": True,
                                                    "temperature": 0}) for i in range(2)]
            bad = c.post("/v1/completions", json={"prompt": [ERROR_TOKEN, 5, 6], "max_tokens": 12})
            bad_stream = c.post("/v1/completions", json={"prompt": [ERROR_TOKEN, 7], "max_tokens": 12,
                                                         "stream": True})
            return await asyncio.gather(*good, bad, bad_stream)

    before = metrics(server).get('tokenloom:request_success_total{finished_reason="error"}', 0)
    g1, g2, bad, bad_stream = asyncio.run(main())
    for g in (g1, g2):
        assert g.status_code == 200 and g.json()["choices"][0]["finish_reason"] == "length"
        assert g.json()["usage"]["completion_tokens"] == 12
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert "InjectedFault" in bad.json()["error"]["message"]
    events = sse_events(bad_stream.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    m = wait_idle(server, headers=H)
    assert m['tokenloom:request_success_total{finished_reason="error"}'] - before == 2
    assert m.get("tokenloom:engine_restarts_total", 0) == 0  # the engine never went down
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------- engine death and hang (last)

def _wait_health(srv, status, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(srv.url + "/health", timeout=5)
            if r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health never returned {status}")


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_engine_fault_restarts_engine(server, fault):
    before = metrics(server)
    restarts = before.get("tokenloom:engine_restarts_total", 0)
    errors = before.get('tokenloom:request_success_total{finished_reason="error"}', 0)
    aborts = before.get('tokenloom:request_success_total{finished_reason="abort"}', 0)
    engines = server.engine_pids()
    t, out = stream_in_thread(server.url, {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True},
                              headers=H)
    deadline = time.time() + 60
    while not out.get("events") and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    if fault == "killed":
        os.kill(engines[0], signal.SIGKILL)
    else:  # a request whose step never returns: the whole batch hangs
        hung = post(server, "/v1/completions", {"prompt": [HANG_TOKEN, 1], "max_tokens": 4})
        assert hung.status_code == 500 and hung.json()["error"]["code"] == "engine_dead", hung.text
    r = _wait_health(server, 503, 5 if fault == "killed" else STEP_TIMEOUT + 5)
    assert r.json()["status"] in ("engine_restarting", "engine_dead")
    assert time.time() - t0 < (3 if fault == "killed" else STEP_TIMEOUT + 5)
    t.join(15)
    assert out["events"][-1] == "[DONE]" and out["events"][-2]["error"]["code"] == "engine_dead"
    new = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    if new.status_code != 200:  # still restarting
        assert new.status_code == 503 and new.json()["error"]["code"] in ("engine_restarting", "engine_dead")
        assert "Retry-After" in new.headers
    _wait_health(server, 200, 120)
    assert_serves(server)
    after = metrics(server)
    assert after["tokenloom:engine_restarts_total"] == restarts + 1
    # the requests the death failed are errors, not client aborts (the stream, and the hung request)
    assert after['tokenloom:request_success_total{finished_reason="error"}'] - errors == (1 if fault == "killed" else 2)
    assert after.get('tokenloom:request_success_total{finished_reason="abort"}', 0) == aborts
    assert not set(engines) & set(server.engine_pids())
    assert len(server.engine_pids()) == 1
