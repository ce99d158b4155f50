"""Request validation against OpenAI's documented rules and vLLM's, and the adversarial probe's
findings, on the real server with the embedded model.

Each rule is one row: a body that breaks it gets a 400 in OpenAI's error shape whose ``param``
names the field, at once, and the server keeps serving. One server for the module.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import ServerProcess, stream_in_thread, wait_idle

CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    try:
        yield srv
    finally:
        srv.terminate()


def post(srv, path, body, **kw):
    if isinstance(body, bytes):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"},
                          timeout=kw.pop("timeout", 60), **kw)
    return httpx.post(srv.url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


def assert_400(r, param, code=None, needle=None):
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if needle is not None:
        assert needle in err["message"], err


C, CH = "/v1/completions", "/v1/chat/completions"

# (path, body, param): each breaks one documented rule (OpenAI's API reference, vLLM's protocol checks).
RULES = [
    # stream-only options (OpenAI and vLLM: 400 without stream: true)
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (CH, {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (CH, {"messages": CHAT, "stream": False, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    # vLLM: prompt_logprobs are not streamed
    (C, {"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    # ranges
    (C, {"prompt": "hi", "n": 0}, "n"),
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CH, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    (C, {"prompt": "hi", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "hi", "top_k": -2}, "top_k"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "seed": 2 ** 64}, "seed"),
    (C, {"prompt": "hi", "priority": 2 ** 63}, "priority"),
    (C, {"prompt": "hi", "priority": -(2 ** 63) - 1}, "priority"),
    (C, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (CH, {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    (C, {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    (C, {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, "min_tokens"),  # vLLM: min_tokens <= max_tokens
    (C, {"prompt": "hi", "stop": ""}, "stop"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "hi", "timeout": 0}, "timeout"),
    (C, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [[]]}, "prompt"),
    (C, {"prompt": [-1]}, "prompt"),
    (CH, {"messages": []}, "messages"),
    (CH, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    (CH, {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    (CH, {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    (CH, {"messages": CHAT, "tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    (CH, {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    (C, {"prompt": "hi", "request_id": ""}, "request_id"),
    # D6: lone surrogates anywhere are a 400 naming the field, not a 500
    (C, b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
    (C, b'{"prompt": ["ok", "a\\udfff"], "max_tokens": 2}', "prompt[1]"),
    (CH, b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', "messages[0].content"),
    (CH, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2}',
     "messages[0].content[0].text"),
    (C, b'{"prompt": "hi", "stop": ["x\\ud800"], "max_tokens": 2}', "stop[0]"),
    (C, b'{"prompt": "hi", "bad_words": ["\\ud800"], "max_tokens": 2}', "bad_words[0]"),
    (C, b'{"prompt": "a\\ud800", "echo": true, "max_tokens": 2}', "prompt"),
    ("/tokenize", b'{"prompt": "a\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    # D6: chat_template_kwargs may not set the renderer's own arguments
    (CH, {"messages": CHAT, "chat_template_kwargs": {"special_tokens": {"bos_token": "x"}}}, "chat_template_kwargs"),
    (CH, {"messages": CHAT, "chat_template_kwargs": {"template": "{{ 1 }}"}}, "chat_template_kwargs"),
    (CH, {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    # D7: a grammar that can never produce a token
    (C, {"prompt": "hi", "guided_grammar": "root ::= root"}, "guided_grammar"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    # D1: templates sent with a request are refused unless the server trusts them
    (CH, {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    # D2: /tokenize has the same prompt limits as generation
    ("/tokenize", {"prompt": "word " * 500_000}, "prompt"),
    # nothing silently ignored: a field that is neither OpenAI's, vLLM's nor an alias; one tokenloom lacks
    (CH, {"messages": CHAT, "bogus_field": 1}, "bogus_field"),
    (C, {"prompt": "hi", "bogus_field": 1}, "bogus_field"),
    ("/v1/responses", {"input": "hi", "bogus_field": 1}, "bogus_field"),
    (CH, {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
    (CH, {"messages": CHAT, "web_search_options": {}}, "web_search_options"),
    # strict types and OpenAI's seed range, from the schema
    (C, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (CH, {"messages": CHAT, "stream": "false"}, "stream"),
    (C, {"prompt": "hi", "seed": 2 ** 64 - 1}, "seed"),
    # a lone surrogate in a key, known or not, anywhere
    (C, b'{"prompt": "hi", "bo\\ud800gus": 1, "max_tokens": 2}', None),
    (CH, b'{"messages": [{"role": "user", "content": "x", "n\\udc00": 1}], "max_tokens": 2}', "messages[0]"),
    (CH, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"\\ud800": 1}}',
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,param", RULES, ids=[f"{i}-{r[2]}" for i, r in enumerate(RULES)])
def test_rule_gives_400_naming_the_field(server, path, body, param):
    t0 = time.time()
    r = post(server, path, body)
    assert_400(r, param)
    assert time.time() - t0 < 10


def test_server_still_serves_after_the_rules(server):
    r = post(server, C, {"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_valid_stream_options_with_stream_are_accepted(server):
    r = post(server, C, {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 2


def test_priority_at_the_64_bit_bounds_is_accepted(server):
    for priority in (2 ** 63 - 1, -(2 ** 63)):
        r = post(server, C, {"prompt": "hi", "max_tokens": 1, "priority": priority})
        assert r.status_code == 200, r.text


def test_invalid_utf8_body_is_400_with_a_code(server):
    r = post(server, C, b'{"prompt": "\xff\xfe", "max_tokens": 2}')
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json" and "UTF-8" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head_on_health_and_metrics(server, path):
    r = httpx.head(server.url + path, timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_request_id_clash_with_a_per_prompt_id_is_400(server):
    """D6: a multi-prompt request with id X uses X-0, X-1, X-2; one of them already running is a 400."""
    t, out = stream_in_thread(server.url, {"prompt": "A long story:", "max_tokens": 48, "ignore_eos": True,
                                           "request_id": "clash-2"})
    deadline = time.time() + 60
    while not out.get("events") and time.time() < deadline:
        time.sleep(0.05)
    assert out.get("events"), out
    r = post(server, C, {"prompt": ["a", "b", "c"], "max_tokens": 2, "request_id": "clash"})
    assert_400(r, "request_id", code="duplicate_request_id")
    r = post(server, C, {"prompt": "a", "max_tokens": 2, "request_id": "clash-2"})
    assert_400(r, "request_id", code="duplicate_request_id")
    t.join(300)
    assert not t.is_alive() and out["events"][-1] == "[DONE]"
    wait_idle(server)
    r = post(server, C, {"prompt": ["a", "b", "c"], "max_tokens": 2, "request_id": "clash"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_tokenize_at_the_size_limit_is_answered_and_health_stays_responsive(server):
    """D2: /tokenize takes prompts up to the generation limit (2,048 tokens x 64 characters here), tokenized
    in worker threads; /health answers meanwhile."""
    prompt = "word " * 26_000  # 130,000 characters: just under 131,072
    results = []

    def tokenize():
        results.append(post(server, "/tokenize", {"prompt": prompt}, timeout=120))

    threads = [threading.Thread(target=tokenize) for _ in range(40)]
    start = time.time()
    for th in threads:
        th.start()
    worst = 0.0
    while any(th.is_alive() for th in threads):
        t0 = time.time()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.time() - t0)
        time.sleep(0.05)
    for th in threads:
        th.join()
    phase = time.time() - start
    assert [r.status_code for r in results] == [200] * 40
    assert results[0].json()["count"] >= 26_000
    # on the event loop (or holding the GIL, or encoding the answers item by item there), /health would wait
    # behind the queued tokenizations, most of the phase (~5 s before the fix); off it, only for its turn.
    # Relative, with a floor for a loaded machine's scheduling noise.
    assert worst < max(1.0, 0.5 * phase), f"/health waited {worst:.2f} s of a {phase:.2f} s tokenize phase"
    wait_idle(server)


# ---------------------------------------------------------------- other engines' spellings, clients' extras

def test_llama_cpp_grammar_field_constrains_the_output(server):
    r = post(server, C, {"prompt": "Is the sky blue?", "grammar": 'root ::= "yes" | "no"', "max_tokens": 5,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")


def test_two_spellings_of_a_constraint_are_a_conflict(server):
    assert_400(post(server, C, {"prompt": "hi", "guided_regex": "b", "grammar": 'root ::= "a"'}), "grammar")


def test_fields_openai_clients_send_are_accepted(server):
    r = post(server, CH, {"messages": CHAT, "max_completion_tokens": 2, "user": "u", "metadata": {"k": "v"},
                          "store": False, "service_tier": "auto", "parallel_tool_calls": False,
                          "modalities": ["text"], "reasoning_effort": "low", "verbosity": "low",
                          "prediction": {"type": "content", "content": "hi"}, "prompt_cache_key": "k",
                          "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- big hostile bodies

# The goal: other clients' /health under 100 ms p99 while a hostile body is refused (it was 4.6 s when bodies
# were parsed on the event loop). On top of it the machine's own noise, measured the same way just before:
# on 2 cores shared by many jobs the OS alone delays a probe by tens of ms.
HEALTH_P99_LIMIT_S = 0.1
HEALTH_NOISE_CAP_S = 0.2  # however noisy the machine, /health may not wait 0.3 s

# Another client, in its own process (so its copying of 15 MB does not hold this process's GIL): it
# sends ~15 MB bodies, a guided_json schema with 450k properties and chat_template_kwargs with 800k keys,
# and prints each answer's status, error param and the seconds it took.
_HOSTILE_CLIENT = """
import json, sys, time, httpx
chat = [{"role": "user", "content": "Say hi."}]
bodies = [{"messages": chat, "guided_json": {"type": "object",
                                             "properties": {f"p{i}": {"type": "string"} for i in range(450_000)}}},
          {"messages": chat, "chat_template_kwargs": {f"k{i}": i for i in range(800_000)}}]
raw = [json.dumps(b).encode() for b in bodies]
print("ready", flush=True)
for body in raw:
    t0 = time.perf_counter()
    r = httpx.post(sys.argv[1] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    error = r.json().get("error") or {}
    print(json.dumps([r.status_code, error.get("param"), error.get("code"), time.perf_counter() - t0]), flush=True)
"""


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _probe_health(client: httpx.Client, latencies: list[float]) -> None:
    t0 = time.perf_counter()
    assert client.get("/health").status_code == 200
    latencies.append(time.perf_counter() - t0)
    time.sleep(0.01)


def test_health_answers_fast_while_big_hostile_bodies_are_refused(server):
    idle: list[float] = []
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(50):  # the machine's own noise, for the record
            _probe_health(client, idle)
        hostile = subprocess.Popen([sys.executable, "-c", _HOSTILE_CLIENT, server.url], stdout=subprocess.PIPE,
                                   text=True)
        assert hostile.stdout is not None and hostile.stdout.readline().strip() == "ready"
        while hostile.poll() is None:
            _probe_health(client, latencies)
    answers = [json.loads(line) for line in hostile.stdout.read().splitlines()]
    assert [a[:3] for a in answers] == [[400, "guided_json", "request_too_large"],
                                        [400, "chat_template_kwargs", "request_too_large"]]
    p99 = _p99(latencies)
    print(f"/health p99 {1e3 * p99:.0f} ms, max {1e3 * max(latencies):.0f} ms over {len(latencies)} probes "
          f"(idle: p99 {1e3 * _p99(idle):.0f} ms); hostile bodies refused in "
          f"{', '.join(f'{a[3]:.2f}' for a in answers)} s")
    assert len(latencies) >= 20
    limit = HEALTH_P99_LIMIT_S + min(_p99(idle), HEALTH_NOISE_CAP_S)
    assert p99 < limit, f"/health p99 {p99:.3f} s (limit {limit:.3f} s) while hostile bodies were refused"
