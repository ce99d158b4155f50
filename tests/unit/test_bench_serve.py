"""`tokenloom bench serve` pieces without a server: statistics, goodput, SLO parsing, prompt
sets, arrival times, SSE parsing against an in-process mock transport, the CLI wiring."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket

import httpx
import pytest

from tokenloom.bench import datasets, report
from tokenloom.bench.client import RequestResult, build_payload, chunk_text, error_message, send_request
from tokenloom.bench.serve import _json_safe, add_serve_bench_args, api_base, arrival_offsets, run_load


def _res(ttft=0.1, latency=1.0, out=10, prompt=20, itl=None, ok=True, cached=None, error=""):
    return RequestResult(success=ok, error=error, ttft=ttft, latency=latency, output_tokens=out, prompt_tokens=prompt,
                         itl=list(itl or []), usage_reported=True, cached_tokens=cached)


# ------------------------------------------------------------------ statistics

def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert report.percentile(xs, 50) == 3.0
    assert report.percentile(xs, 0) == 1.0 and report.percentile(xs, 100) == 5.0
    assert report.percentile(xs, 90) == pytest.approx(4.6)
    assert report.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert report.percentile([7.0], 99) == 7.0
    assert math.isnan(report.percentile([], 50))
    d = report.describe([1.0, 2.0, 3.0, 10.0])
    assert d["mean"] == 4.0 and d["p50"] == 2.5 and set(d) == {"mean", "p50", "p90", "p99"}


def test_tpot_and_summary_numbers():
    r = _res(ttft=0.2, latency=2.0, out=10)
    assert r.tpot == pytest.approx(0.2)
    assert _res(out=1).tpot is None
    results = [_res(ttft=0.1, latency=1.0, out=10, prompt=20, itl=[0.1] * 9, cached=16),
               _res(ttft=0.3, latency=2.1, out=10, prompt=30, itl=[0.2] * 9, cached=0),
               _res(ok=False, error="HTTP 500: boom", out=0, prompt=0)]
    s = report.summarize(results, 4.0, max_concurrency=2)
    assert s["completed"] == 2 and s["failed"] == 1 and s["first_error"] == "HTTP 500: boom"
    assert s["total_input_tokens"] == 50 and s["total_output_tokens"] == 20 and s["cached_input_tokens"] == 16
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2el_ms"]["p50"] == pytest.approx(1550.0)
    assert s["max_concurrency"] == 2 and "goodput" not in s
    text = report.format_summary(s)
    for label in ("Successful requests:", "Failed requests:", "P99 TTFT (ms):", "Mean TPOT (ms):", "P90 ITL (ms):",
                  "P50 E2EL (ms):", "Output token throughput", "first error: HTTP 500: boom"):
        assert label in text
    json.dumps(_json_safe(s), allow_nan=False)


def test_summary_of_all_failures_is_nan_not_a_crash():
    s = report.summarize([_res(ok=False, error="x")], 1.0, {"ttft": 100})
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["p50"]) and s["goodput"] == 0
    assert "nan" in report.format_summary(s)
    assert json.loads(json.dumps(_json_safe(s), allow_nan=False))["ttft_ms"]["p50"] is None


def test_parse_slo():
    assert report.parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert report.parse_slo(" TTFT=1.5ms , e2e=2000") == {"ttft": 1.5, "e2el": 2000.0}
    assert report.parse_slo(None) == {} and report.parse_slo("") == {}
    for bad in ("ttft", "foo=1", "ttft=abc", "tpot=-1", "ttft=0"):
        with pytest.raises(ValueError):
            report.parse_slo(bad)


def test_goodput_counts_requests_meeting_every_limit():
    slo = {"ttft": 200.0, "tpot": 50.0}
    fast = _res(ttft=0.1, latency=0.1 + 9 * 0.04, out=10)      # ttft 100, tpot 40
    slow_first = _res(ttft=0.3, latency=0.3 + 9 * 0.04, out=10)  # ttft 300
    slow_decode = _res(ttft=0.1, latency=0.1 + 9 * 0.06, out=10)  # tpot 60
    one_token = _res(ttft=0.15, latency=0.15, out=1)             # no tpot: counts as met
    failed = _res(ok=False)
    assert report.meets_slo(fast, slo) and report.meets_slo(one_token, slo)
    assert not report.meets_slo(slow_first, slo) and not report.meets_slo(slow_decode, slo)
    assert not report.meets_slo(failed, slo)
    s = report.summarize([fast, slow_first, slow_decode, one_token, failed], 2.0, slo)
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert "Goodput (req/s, ttft<=200ms, tpot<=50ms):" in report.format_summary(s)


def test_sweep_table_and_plot(tmp_path):
    runs = [report.summarize([_res(ttft=0.1 * c, latency=1.0 + c, out=10, itl=[0.1])], 2.0, max_concurrency=c)
            for c in (1, 4)]
    table = report.format_sweep(runs)
    assert "TTFT p50" in table and len(table.splitlines()) == 5
    path = tmp_path / "sweep.png"
    report.plot_sweep(runs, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ prompt sets

def test_random_dataset_lengths_and_determinism():
    a = datasets.random_dataset(50, 100, 20, range_ratio=0.5, seed=3)
    b = datasets.random_dataset(50, 100, 20, range_ratio=0.5, seed=3)
    c = datasets.random_dataset(50, 100, 20, range_ratio=0.5, seed=4)
    assert [p.prompt for p in a] == [p.prompt for p in b] != [p.prompt for p in c]
    assert all(50 <= p.input_len <= 150 and 10 <= p.output_len <= 30 for p in a)
    assert len({p.input_len for p in a}) > 5
    for p in a:  # one word per token at tokens_per_word=1
        assert len(p.prompt.split()) == p.input_len and p.prefix == ""
    fixed = datasets.random_dataset(5, 64, 8)
    assert {p.input_len for p in fixed} == {64} and {p.output_len for p in fixed} == {8}
    assert len(datasets.random_dataset(1, 100, 8, tokens_per_word=1.25)[0].prompt.split()) == 80
    with pytest.raises(ValueError):
        datasets.random_dataset(1, 10, 10, range_ratio=1.0)


def test_words_are_distinct_plain_words():
    assert len(datasets.WORDS) == len(set(datasets.WORDS)) > 150
    assert all(w.isalpha() and w.islower() for w in datasets.WORDS)


def test_shared_prefix_dataset_groups():
    ps = datasets.shared_prefix_dataset(10, num_groups=3, prefix_len=40, input_len=8, output_len=4, seed=1)
    assert [p.group for p in ps] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    prefixes = {p.group: p.prefix for p in ps}
    assert len(set(prefixes.values())) == 3
    for p in ps:
        assert p.prefix == prefixes[p.group] and len(p.prefix.split()) == 40 and len(p.prompt.split()) == 8
        assert p.input_len == 48 and p.output_len == 4
        assert p.completion_prompt().startswith(p.prefix)
        msgs = p.chat_messages()
        assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == p.prefix.strip()
    assert len({p.prompt for p in ps}) == 10  # each request has its own suffix


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there"}\n\n{"prompt": "second one", "output_len": 3, "system": "be brief"}\n')
    ps = datasets.jsonl_dataset(str(f), 5, output_len=7)
    assert [p.prompt for p in ps] == ["hello there", "second one"] * 2 + ["hello there"]
    assert [p.output_len for p in ps] == [7, 3, 7, 3, 7]
    assert ps[1].chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert ps[0].chat_messages() == [{"role": "user", "content": "hello there"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.jsonl_dataset(str(bad), 1, 4)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=":1:"):
        datasets.jsonl_dataset(str(bad), 1, 4)


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    offs = arrival_offsets(4000, 20.0, 1.0, 0)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.05, rel=0.08)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps: Poisson arrivals
    steady = arrival_offsets(4000, 20.0, 16.0, 0)
    sg = [b - a for a, b in zip(steady, steady[1:])]
    sm = sum(sg) / len(sg)
    assert sm == pytest.approx(0.05, rel=0.05)
    assert math.sqrt(sum((g - sm) ** 2 for g in sg) / len(sg)) / sm == pytest.approx(0.25, abs=0.05)
    assert arrival_offsets(10, 5.0, 1.0, 7) == arrival_offsets(10, 5.0, 1.0, 7)


# ------------------------------------------------------------------ client

def test_api_base_and_payload():
    assert api_base("http://h:1") == ("http://h:1", "http://h:1/v1")
    assert api_base("http://h:1/v1/") == ("http://h:1", "http://h:1/v1")
    p = datasets.BenchPrompt(prompt=" a b", output_len=5, input_len=2, prefix=" sys")
    body = build_payload("completions", "m", p, ignore_eos=True)
    assert body["prompt"] == " sys a b" and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = build_payload("chat", "m", p)
    assert chat["messages"][0]["role"] == "system" and "ignore_eos" not in chat and "prompt" not in chat


def test_error_message_and_chunk_text():
    assert error_message(400, b'{"error": {"message": "too long", "type": "x"}}') == "HTTP 400: too long"
    assert error_message(503, b'{"detail": "busy"}') == "HTTP 503: busy"
    assert error_message(502, b"bad gateway") == "HTTP 502: bad gateway"
    assert chunk_text({"choices": [{"index": 0, "text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {}}) == ""


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def _mock(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _stream_ok(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(n)]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                                            "prompt_tokens_details": {"cached_tokens": 4}}})
    return httpx.Response(200, content=_sse(*chunks, b"[DONE]") + b": keep-alive\n\n",
                          headers={"content-type": "text/event-stream"})


def test_send_request_parses_stream_and_usage():
    async def go():
        async with _mock(_stream_ok) as c:
            return await send_request(c, "http://x/v1/completions", {"max_tokens": 5})
    r = asyncio.run(go())
    assert r.success and r.error == "" and r.usage_reported
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (7, 5, 4)
    assert len(r.itl) == 4 and 0 < r.ttft <= r.latency and r.tpot is not None


def test_send_request_without_usage_counts_chunks():
    def handler(request):
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                                                {"choices": [{"delta": {"content": "a"}}]},
                                                {"choices": [{"delta": {"content": "b"}}]}, b"[DONE]"))

    async def go():
        async with _mock(handler) as c:
            return await send_request(c, "http://x/v1/chat/completions", {})
    r = asyncio.run(go())
    assert r.success and not r.usage_reported and r.output_tokens == 2 and len(r.itl) == 1


def test_send_request_failures():
    def http_error(request):
        return httpx.Response(400, json={"error": {"message": "prompt is too long", "code": "x"}})

    def stream_error(request):
        return httpx.Response(200, content=_sse({"choices": [{"text": "a"}]},
                                                {"error": {"message": "engine died"}}, b"[DONE]"))

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    async def go(h):
        async with _mock(h) as c:
            return await send_request(c, "http://x/v1/completions", {})
    r1, r2, r3 = (asyncio.run(go(h)) for h in (http_error, stream_error, refuse))
    assert not r1.success and r1.error == "HTTP 400: prompt is too long"
    assert not r2.success and r2.error == "stream error: engine died"
    assert not r3.success and "ConnectError" in r3.error and "refused" in r3.error


def test_run_load_respects_max_concurrency():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return _stream_ok(request)

    prompts = datasets.random_dataset(9, 8, 3, seed=0)
    results, duration = asyncio.run(run_load(prompts, api="http://x/v1", endpoint="completions", model="m",
                                             max_concurrency=2, progress=False,
                                             transport=httpx.MockTransport(handler)))
    assert len(results) == 9 and all(r.success for r in results) and state["peak"] == 2
    assert duration > 0 and sum(r.output_tokens for r in results) == 27
    assert all(r.expected_output_len == 3 for r in results)


def test_cli_arguments():
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    ns = p.parse_args([])
    assert ns.base_url == "http://127.0.0.1:8000" and ns.endpoint == "completions" and ns.dataset == "random"
    assert ns.request_rate == math.inf and ns.burstiness == 1.0 and ns.max_concurrency is None
    assert callable(ns.func)
    ns = p.parse_args(["--sweep", "1,4,16", "--endpoint", "chat", "--dataset", "shared-prefix", "--num-groups", "2",
                       "--prefix-len", "100", "--ignore-eos", "--slo", "ttft=100"])
    assert ns.sweep == [1, 4, 16] and ns.ignore_eos and ns.num_groups == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--sweep", "1,0"])


def test_bench_cli_has_serve_subcommand():
    from tokenloom.bench.cli import add_bench_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    ns = p.parse_args(["serve", "--num-prompts", "3"])
    assert ns.num_prompts == 3 and ns.func.__name__ == "run_serve_bench"


def test_unreachable_server_is_exit_2(capsys):
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    ns = p.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm"])
    assert ns.func(ns) == 2
    assert "cannot list the models" in capsys.readouterr().err
