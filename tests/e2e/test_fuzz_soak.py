"""Fuzzing and soak against the real server (loopback only), one server for the module.

* schemathesis generates requests from the server's own OpenAPI schema (/openapi.json):
  none may get a 5xx (except the documented 503 overload / 504 timeout) or hang;
* hypothesis throws random parameter combinations at /v1/completions and
  /v1/chat/completions: every answer is 200 or a 4xx in OpenAI's error shape;
* the soak mixes streamed, non-streamed, cancelled and invalid requests; afterwards every
  request got an answer, the engine holds no KV block, the API process's RSS stayed flat
  after warm-up, and the server still answers correctly. `make soak` runs the long version.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import ServerProcess, metric_values, wait_idle

API_KEY = "fuzz-key"
H = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 4  # generation is slow on shared CPUs: keep every fuzzed request short
TOLERATED_5XX = {(503, "server_overloaded"), (504, "request_timeout"), (503, "overloaded_error"),
                 (504, "timeout_error")}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", API_KEY, "--max-num-seqs", "8", "--max-waiting-requests", "32")
    try:
        r = httpx.post(srv.url + "/v1/completions", headers=H, timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
        srv.reference_text = r.json()["choices"][0]["text"]  # greedy output before any fuzzing
        yield srv
    finally:
        code = srv.terminate()
        assert code == 0, srv.log_text()


def metrics(srv) -> dict[str, float]:
    return metric_values(httpx.get(srv.url + "/metrics", headers=H, timeout=30).text)


def error_in_its_apis_shape(path: str, body) -> bool:
    """Each API answers errors in its own shape: Ollama's `{"error": "..."}` under /api/, llama-server's
    `{"error": {"code", "message", "type"}}` on /completion and /props, Anthropic's
    `{"type": "error", "error": {"type", "message"}}` on /v1/messages, OpenAI's everywhere else."""
    err = body.get("error") if isinstance(body, dict) else None
    if path.startswith("/api/"):
        return isinstance(err, str) and bool(err)
    if not isinstance(err, dict) or not err.get("message"):
        return False
    if path in ("/completion", "/props"):
        return set(err) == {"code", "message", "type"}
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and set(err) == {"message", "type"}
    return set(err) == {"message", "type", "param", "code"}


def check_answer(r: httpx.Response, what, path: str = "/v1/completions") -> None:
    if r.status_code >= 500:
        try:
            err = r.json()["error"]
            code = err.get("code", err["type"])  # Anthropic's errors have a type only
        except Exception:  # noqa: BLE001
            code = None
        assert (r.status_code, code) in TOLERATED_5XX, (what, r.status_code, r.text[:500])
    elif r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        assert error_in_its_apis_shape(path, r.json()), (what, r.text[:300])


# Each API's own name for the output length: capped, or set when the fuzzer left it out, so no fuzzed
# request generates up to the context (tens of seconds on 2 cores).
LENGTH_FIELD = {"/v1/responses": "max_output_tokens", "/completion": "n_predict"}


def _cap(holder: dict, key: str) -> None:
    """Set when absent, lower when a larger int; any other value stays for the server to refuse."""
    v = holder.get(key, MAX_TOKENS + 1)
    if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
        holder[key] = MAX_TOKENS


def _short(body, path: str = "/v1/completions"):
    """Keep fuzzed generation requests cheap: a small output length in each API's own field."""
    if isinstance(body, dict):
        if path in ("/api/chat", "/api/generate"):
            options = body.get("options")
            if not isinstance(options, dict):
                options = body["options"] = {}
            _cap(options, "num_predict")
        elif path in LENGTH_FIELD:
            _cap(body, LENGTH_FIELD[path])
        elif "max_completion_tokens" in body:
            _cap(body, "max_completion_tokens")
        else:
            _cap(body, "max_tokens")
        v = body.get("min_tokens")
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
            body["min_tokens"] = MAX_TOKENS
        for key in ("n", "best_of"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 4:
                body[key] = 4
    return body


# ---------------------------------------------------------------- schemathesis

def test_schemathesis_finds_no_server_errors(server):
    import schemathesis

    raw = httpx.get(server.url + "/openapi.json", headers=H, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    ops = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in ops)
    seen = 0
    with httpx.Client(base_url=server.url, headers=H, timeout=30) as client:
        for op in ops:
            examples = 25 if op.method.upper() == "POST" else 5

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def run(case):
                nonlocal seen
                path = case.formatted_path if hasattr(case, "formatted_path") else op.path
                body = _short(case.body, path) if op.method.upper() == "POST" else None
                kwargs = {"json": body} if body is not None and not isinstance(body, schemathesis.core.NotSet) else {}
                t0 = time.time()
                r = client.request(op.method.upper(), path, params=case.query or None, **kwargs)
                assert time.time() - t0 < 30, (op.path, "hang")
                check_answer(r, (op.method, path, body), path)
                seen += 1

            run()
    assert seen >= 50
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------- hypothesis on the parameters

_num = st.one_of(st.none(), st.integers(-5, 40), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                 st.booleans())
_params = st.fixed_dictionaries({}, optional={
    "temperature": _num, "top_p": _num, "top_k": _num, "min_p": _num, "n": st.integers(-1, 5),
    "max_tokens": st.one_of(st.integers(-2, MAX_TOKENS), st.none(), st.just("x")),
    "min_tokens": st.integers(-1, 3), "presence_penalty": _num, "frequency_penalty": _num,
    "repetition_penalty": _num, "seed": st.one_of(st.integers(-2 ** 64, 2 ** 65), st.none()),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20)),
    "stop_token_ids": st.lists(st.integers(-3, 60000), max_size=4),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 60000).map(str), st.text(max_size=3)),
                                  st.floats(-200, 200), max_size=4),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), st.none()),
    "top_logprobs": st.integers(-1, 25), "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 25)),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "echo": st.booleans(),
    "bad_words": st.lists(st.text(max_size=5), max_size=3), "best_of": st.integers(0, 5),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(-1, 60000), max_size=5)),
    "include_stop_str_in_output": st.booleans(), "priority": st.integers(-3, 3),
    "stream": st.booleans(), "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
    "timeout": st.one_of(st.none(), st.floats(-1, 60)), "return_token_ids": st.booleans(),
    "response_format": st.one_of(st.none(), st.just({"type": "json_object"}), st.just({"type": "text"})),
})
_prompt = st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 49200), max_size=6),
                    st.lists(st.text(max_size=5), max_size=3), st.just([]), st.integers())
_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
    "content": st.one_of(st.text(max_size=20), st.none(), st.just([{"type": "text", "text": "hi"}]),
                         st.just([{"type": "image_url"}]))}), max_size=4)


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), params=_params, prompt=_prompt, messages=_messages)
def test_random_parameters_never_break_the_server(server, chat, params, prompt, messages):
    body = dict(params)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS
    body.setdefault("max_tokens", MAX_TOKENS)
    if chat:
        body["messages"] = messages
        if isinstance(body.get("logprobs"), int) and not isinstance(body.get("logprobs"), bool):
            body["logprobs"] = bool(body["logprobs"])
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        if isinstance(body.get("logprobs"), bool):
            body.pop("logprobs")
        path = "/v1/completions"
    t0 = time.time()
    # NaN / Infinity go out as the literals Python's JSON (and so the server) accepts
    r = httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                   headers={**H, "Content-Type": "application/json"})
    assert time.time() - t0 < 60
    check_answer(r, body)
    if r.status_code == 200 and body.get("stream") is True:
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", r.text[-300:]
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert (chunk["error"].get("status_code"), chunk["error"]["code"]) in TOLERATED_5XX, chunk


# ---------------------------------------------------------------- soak

def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


KINDS = ["plain", "plain", "stream", "stream", "chat", "cancel", "cancel_stream", "invalid"]
# What each kind of request may end as. Anything else (a 5xx, a stream ended by an error, a status no
# kind expects) is counted under its own name and fails the soak's final tally.
EXPECTED = {"plain": {"ok", "rejected"}, "stream": {"ok", "rejected"}, "chat": {"ok", "rejected"},
            "cancel": {"ok", "rejected", "cancelled"}, "cancel_stream": {"ok", "rejected", "cancelled"},
            "invalid": {"invalid"}}


def _outcome(kind: str, r: httpx.Response, body: dict) -> str:
    """How one answer ended: ok, rejected (503), invalid (400), or a name for anything unexpected."""
    if r.status_code == 200:
        if body.get("stream") and not (r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text):
            return "stream cut or in error"
        return "ok"
    if r.status_code == 503:
        return "rejected"
    if r.status_code == 400 and kind == "invalid":
        return "invalid"
    return f"status {r.status_code}"


async def _soak(srv, seconds: float, concurrency: int, seed: int = 0) -> tuple[Counter, Counter]:
    """(requests sent by kind, outcomes by (kind, outcome)) of a mixed load for `seconds`."""
    rng = random.Random(seed)
    sent: Counter = Counter()
    ended: Counter = Counter()
    deadline = time.time() + seconds
    words = ["alpha", "beta", "gamma", "delta", "sea", "sky", "tree", "stone"]

    async def one(c: httpx.AsyncClient) -> None:
        kind = rng.choice(KINDS)
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        body: dict = {"max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.7, 1.0])}
        if kind == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if kind in ("stream", "cancel_stream"):
            body["stream"] = True
        if kind == "invalid":
            body[rng.choice(["temperature", "n", "top_p", "logprobs"])] = rng.choice([-1, "x"])
        sent[kind] += 1
        if kind.startswith("cancel"):
            body["max_tokens"] = 64
            try:
                r = await c.post(path, json=body, timeout=rng.uniform(0.05, 0.6))
            except httpx.TimeoutException:
                ended[kind, "cancelled"] += 1  # the client gave up: the server must abort the request
                return
            # answered before the client gave up: it must be a complete, valid answer like any other
        else:
            r = await c.post(path, json=body, timeout=120)
        check_answer(r, body)
        ended[kind, _outcome(kind, r, body)] += 1

    async def worker(c: httpx.AsyncClient) -> None:
        while time.time() < deadline:
            await one(c)

    async with httpx.AsyncClient(base_url=srv.url, headers=H) as c:
        await asyncio.gather(*[worker(c) for _ in range(concurrency)])
    return sent, ended


def run_soak(srv, seconds: float, concurrency: int = 6) -> None:
    asyncio.run(_soak(srv, min(10.0, seconds / 4), concurrency, seed=1))  # warm-up
    before = wait_idle(srv, headers=H)
    rss0 = _rss_kb(srv.pid)
    sent, ended = asyncio.run(_soak(srv, seconds, concurrency, seed=2))
    m = wait_idle(srv, headers=H)  # no request left running, no KV block leaked
    rss1 = _rss_kb(srv.pid)
    # every request ended in a way its kind allows: one that did not (a 5xx, a cut stream, a 200 for an
    # invalid request) is missing from the left side
    as_expected = sum(n for (kind, outcome), n in ended.items() if outcome in EXPECTED[kind])
    assert as_expected == sum(sent.values()), (sent, ended)
    outcomes: Counter = Counter()
    for (_, outcome), n in ended.items():
        outcomes[outcome] += n
    assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0 and outcomes["invalid"] > 0, ended
    assert ended["stream", "ok"] > 0, ended
    # every client that gave up mid-request had its request aborted in the engine (a cancel that came
    # before the request reached the engine aborts nothing there), and nothing else was aborted
    aborted = (m.get('tokenloom:request_success_total{finished_reason="abort"}', 0)
               - before.get('tokenloom:request_success_total{finished_reason="abort"}', 0))
    assert 0 < aborted <= outcomes["cancelled"], (aborted, ended)
    assert m["tokenloom:kv_cache_used_blocks"] == 0
    assert rss1 - rss0 < max(30_000, rss0 * 0.10), (rss0, rss1)  # flat after warm-up (KiB)
    served = sum(m.get(f'tokenloom:request_success_total{{finished_reason="{r}"}}', 0) -
                 before.get(f'tokenloom:request_success_total{{finished_reason="{r}"}}', 0)
                 for r in ("stop", "length"))
    assert served >= outcomes["ok"], (served, ended)
    # still correct: greedy output is what it was before the soak
    r = httpx.post(srv.url + "/v1/completions", headers=H, timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.reference_text
    print(f"soak {seconds:.0f} s: sent {dict(sent)}, ended {dict(ended)}, RSS {rss0} -> {rss1} KiB")


@pytest.mark.slow  # 30 s of load (make soak-ci)
def test_soak_short(server):
    run_soak(server, seconds=30)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 600 s of load, its warm-up and the checks after it (the suite's 300 s is per test)
def test_soak_long(server):
    run_soak(server, seconds=600, concurrency=12)
