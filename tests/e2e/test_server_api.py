"""The real server on the embedded model, driven by the official openai client and httpx.

One server at a time (API key on, small body limit); every endpoint, streaming vs
non-streaming equality, usage, every error class, metrics counters, disconnect aborts.
Every test runs twice: on one rank, and with the model split over three worker processes
(`-tp 3`), which must answer the same way.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_harness import ServerProcess, metric_values

API_KEY = "test-key-123"
BODY_LIMIT = 200_000
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=[pytest.param(1, id="tp1"), pytest.param(3, id="tp3", marks=pytest.mark.tp)])
def server(request):
    srv = ServerProcess("--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT),
                        "--log-requests", "stages", "--tensor-parallel-size", str(request.param))
    try:
        yield srv
    finally:
        code = srv.terminate()
        assert code == 0, srv.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(server) -> dict[str, float]:
    return metric_values(server.get("/metrics", headers=auth()).text)


# ---------------------------------------------------------------- simple endpoints

def test_ready_line_and_health(server):
    line = next(out for out in server.stdout_lines if "tokenloom serving" in out)
    assert "smollm2-135m-instruct" in line and "blocks" in line and "full-length" in line
    r = server.get("/health")  # open without the key
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = server.get("/version", headers=auth())
    assert r.status_code == 200 and r.json()["version"]


def test_models(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_detokenize(server):
    r = server.post("/tokenize", json={"prompt": "hello world"}, headers=auth())
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 2048
    r = server.post("/detokenize", json={"tokens": body["tokens"]}, headers=auth())
    assert r.status_code == 200 and r.json()["prompt"] == "hello world"
    r = server.post("/tokenize", json={"messages": CHAT}, headers=auth())
    assert r.status_code == 200 and r.json()["count"] > 5
    r = server.post("/detokenize", json={"tokens": [10 ** 9]}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------- chat

def test_chat_stream_equals_non_stream_and_usage(server, client):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.model == server.model and full.created > 0 and full.system_fingerprint
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    n_prompt = server.post("/tokenize", json={"messages": CHAT}, headers=auth()).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 0 < full.usage.completion_tokens <= 8
    assert full.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_raw_sse_done_and_token_ids(server):
    r = server.post("/v1/chat/completions", headers=auth(), json={
        "messages": CHAT, "max_completion_tokens": 4, "temperature": 0, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["usage"] is not None for c in chunks)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert len(ids) == chunks[-1]["usage"]["completion_tokens"] <= 4


def test_chat_n_logprobs_stop(server, client):
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, n=2, temperature=0.8,
                                       seed=7, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        # one logprob entry per generated token (usage counts both choices' tokens)
        assert len(c.logprobs.content) > 0
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
    greedy = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
    words = greedy.choices[0].message.content.split()
    assert len(words) >= 3, greedy.choices[0].message.content  # 16 tokens always hold three words
    stop_word = words[2]
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=16, temperature=0,
                                       stop=[stop_word], extra_body={"ignore_eos": True})
    text = r.choices[0].message.content
    assert stop_word not in text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra.get("stop_reason") == stop_word
    assert greedy.choices[0].message.content.startswith(text)  # the same greedy text, cut before the stop word


# ---------------------------------------------------------------- completions

def test_completion_prompt_forms_and_echo(server, client):
    ids = server.post("/tokenize", json={"prompt": "The sky is"}, headers=auth()).json()["tokens"]
    a = client.completions.create(model=server.model, prompt="The sky is", max_tokens=4, temperature=0)
    assert a.id.startswith("cmpl-") and a.object == "text_completion"
    b = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens <= 4
    many = client.completions.create(model=server.model, prompt=["The sky is", "Paris is"], max_tokens=3,
                                     temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy
    n_paris = len(server.post("/tokenize", json={"prompt": "Paris is"}, headers=auth()).json()["tokens"])
    assert many.usage.prompt_tokens == len(ids) + n_paris
    assert 4 <= many.usage.completion_tokens <= 12
    lists = client.completions.create(model=server.model, prompt=[ids, ids], max_tokens=2, temperature=0)
    assert len(lists.choices) == 2
    echo = client.completions.create(model=server.model, prompt="The sky is", max_tokens=4, temperature=0,
                                     echo=True, logprobs=1)
    assert echo.choices[0].text == "The sky is" + a.choices[0].text
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + a.usage.completion_tokens


def test_completion_stream_equals_non_stream(server, client):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_return_token_ids_match_usage(server):
    r = server.post("/v1/completions", headers=auth(), json={
        "prompt": "Count: one, two,", "max_tokens": 5, "temperature": 0, "return_token_ids": True,
        "prompt_logprobs": 1})
    body = r.json()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    plp = choice["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(str(t) in pos for t, pos in zip(choice["prompt_token_ids"][1:], plp[1:]))


def _cached_tokens(server, prompt: str) -> tuple[int, int]:
    r = server.post("/v1/completions", headers=auth(), json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def test_prefix_cache_hits_are_reported_and_reset_clears_them(server):
    prompt = "Prefix caching check: " + " ".join(f"item {i}," for i in range(40))
    _cached_tokens(server, prompt)
    cached, total = _cached_tokens(server, prompt)
    assert cached >= total - 16 and cached > 0
    assert server.post("/reset_prefix_cache").status_code == 401
    r = server.post("/reset_prefix_cache", headers=auth())
    assert r.status_code == 200, r.text
    assert _cached_tokens(server, prompt)[0] == 0


# ---------------------------------------------------------------- errors

def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_auth_errors(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert _err(r, 401)["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
    assert _err(r, 401)["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert server.get("/health").status_code == 200
    assert server.get("/metrics", headers=auth()).status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "n": 20}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({}, "prompt"),
])
def test_completion_validation_400(server, body, param):
    err = _err(server.post("/v1/completions", json=body, headers=auth()), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
])
def test_chat_validation_400(server, body, param):
    err = _err(server.post("/v1/chat/completions", json=body, headers=auth()), 400)
    assert err["param"] == param


def test_openai_client_sees_bad_request(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=CHAT, temperature=-0.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


def test_context_length_exceeded(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hello " * 3000, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "2048" in e.value.body["message"]


def test_unknown_model_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_malformed_bodies(server):
    h = {**auth(), "Content-Type": "application/json"}
    err = _err(httpx.post(server.url + "/v1/completions", content=b"{not json", headers=h), 400)
    assert err["code"] == "invalid_json"
    err = _err(httpx.post(server.url + "/v1/completions", content=b"[1, 2]", headers=h), 400)
    err = _err(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi"}',
                          headers={**auth(), "Content-Type": "text/plain"}), 400)
    assert err["code"] == "invalid_content_type"
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)}, headers=auth()),
               413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds for chunked bodies too
        for _ in range(30):
            yield b"x" * 10_000

    _err(httpx.post(server.url + "/v1/completions", content=chunks(), headers=h), 413)
    _err(httpx.get(server.url + "/v1/nothing-here", headers=auth()), 404)
    _err(httpx.get(server.url + "/v1/completions", headers=auth()), 405)


def test_custom_request_id(server):
    r = server.post("/v1/completions", headers=auth(),
                    json={"prompt": "hi", "max_tokens": 1, "request_id": "my-req-1"})
    assert r.status_code == 200 and r.json()["id"] == "my-req-1"


# ---------------------------------------------------------------- metrics

def test_metrics_counters_match_usage(server, client):
    before = metrics(server)
    usages = []
    r = client.completions.create(model=server.model, prompt="One two three", max_tokens=3, temperature=0)
    usages.append((r.usage, r.choices[0].finish_reason))
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=3, temperature=0)
    usages.append((r.usage, r.choices[0].finish_reason))
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    usages.append((chunks[-1].usage, reason))
    after = metrics(server)

    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert d("tokenloom:prompt_tokens_total") == sum(u.prompt_tokens for u, _ in usages)
    assert d("tokenloom:generation_tokens_total") == sum(u.completion_tokens for u, _ in usages)
    for reason in ("stop", "length"):
        expected = sum(1 for _, r in usages if r == reason)
        assert d(f'tokenloom:request_success_total{{finished_reason="{reason}"}}') == expected
    assert d("tokenloom:e2e_request_latency_seconds_count") == 3
    assert d("tokenloom:time_to_first_token_seconds_count") == 3
    assert d("tokenloom:request_queue_time_seconds_count") == 3
    assert d("tokenloom:iteration_tokens_total_count") > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "inter_token_latency_seconds_count", "request_prefill_time_seconds_count",
                 "request_decode_time_seconds_count"):
        assert "tokenloom:" + name in after, name
    assert any(k.startswith("tokenloom:cache_config_info") for k in after)
    assert after["tokenloom:num_requests_running"] == 0


# ---------------------------------------------------------------- cancellation

def test_disconnects_abort_requests(server, client):
    before = metrics(server)

    async def fire():
        async with httpx.AsyncClient(timeout=30, headers=auth()) as http:
            async def consume(i):
                body = {"prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True,
                        "stream": i % 2 == 0}
                async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass

            async def one(i):  # a deadline on the whole request: a stream keeps a read timeout alive
                try:
                    await asyncio.wait_for(consume(i), timeout=0.5)
                except asyncio.TimeoutError:
                    return True
                return False

            return await asyncio.gather(*(one(i) for i in range(50)))

    timed_out = asyncio.run(fire())
    assert sum(timed_out) >= 45  # 400 tokens cannot come in 0.5 s here
    deadline = time.time() + 20
    while time.time() < deadline:
        m = metrics(server)
        if m["tokenloom:num_requests_running"] == 0 and m["tokenloom:num_requests_waiting"] == 0:
            break
        time.sleep(0.5)
    assert m["tokenloom:num_requests_running"] == 0 and m["tokenloom:num_requests_waiting"] == 0, m
    aborted = m['tokenloom:request_success_total{finished_reason="abort"}'] - before.get(
        'tokenloom:request_success_total{finished_reason="abort"}', 0)
    assert aborted >= sum(timed_out)
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert server.get("/health").status_code == 200
