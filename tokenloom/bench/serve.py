"""`tokenloom bench serve`: a load generator for any OpenAI-compatible server.

It builds a prompt set (random, shared-prefix, a jsonl file or ShareGPT JSON), sends the requests as
streaming completions or chat completions at a given request rate (Poisson or gamma
arrivals) under an optional concurrency cap, and reports throughput and latency
(TTFT, TPOT, ITL, end to end) measured on the client side, with token counts from the
server's ``usage``. ``--sweep`` repeats the run for several concurrencies; ``--plot``
draws the sweep; every point of a sweep gets fresh prompts (the seed plus the point's
index), so no point is served from prefixes a previous point cached. Only HTTP is used, so
it measures tokenloom, vLLM or llama.cpp alike. `vllm bench serve`'s flag names are accepted
as aliases (--dataset-name, --random-input-len, --save-result, --goodput, --backend, ...).

Exit status: 0 when every request succeeded, 1 when some failed (the report is still
printed and written), 2 on a usage or connection error before the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from typing import AsyncIterator, Sequence, TypeVar

import httpx
from tqdm import tqdm

from tokenloom.bench import datasets, report
from tokenloom.bench.client import ENDPOINTS, RequestResult, build_payload, send_request
from tokenloom.bench.datasets import BenchPrompt
from tokenloom.core.json_types import JsonObject, JsonValue

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _concurrency_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"concurrencies must be positive integers, got {text!r}")
    return out


# vLLM's --dataset-name values -> ours.
DATASET_NAMES = {"random": "random", "shared-prefix": "shared-prefix", "prefix_repetition": "shared-prefix",
                 "jsonl": "jsonl", "custom": "jsonl", "sharegpt": "sharegpt", "repetitive": "repetitive"}
# vLLM's --backend values and --endpoint paths -> our endpoint names.
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ENDPOINT_PATHS = {"completions": "completions", "chat": "chat", "/v1/completions": "completions",
                  "/v1/chat/completions": "chat"}


def _choice(table: dict[str, str], what: str):
    def parse(text: str) -> str:
        if text not in table:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r} (one of {', '.join(table)})")
        return table[text]
    parse.__name__ = what
    return parse


def _goodput(text: str) -> str:
    """vLLM's --goodput KEY:MS -> our --slo KEY=MS."""
    key, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY:MS (e.g. ttft:500), got {text!r}")
    return f"{key}={value}"


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, reason: str, **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise ValueError(f"{option_string}: {self.reason}")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Load test of an OpenAI-compatible server (tokenloom, vLLM, llama.cpp, ...): streaming "
                     "requests, client-side TTFT/TPOT/ITL/E2E latency, throughput from the server's usage.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help=f"server root, with or without /v1 (default {DEFAULT_BASE_URL})")
    g.add_argument("--host", default=None, help="server host, when --base-url is not given (vLLM's flag)")
    g.add_argument("--port", type=int, default=None, help="server port, when --base-url is not given (vLLM's flag)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME",
                   help="LoRA adapters the server serves: request i names adapter i mod N as its model (vLLM's flag; "
                        "it picks at random)")
    g.add_argument("--endpoint", type=_choice(ENDPOINT_PATHS, "endpoint"), default="completions",
                   help="completions (/v1/completions) or chat (/v1/chat/completions); the paths are accepted too; "
                        "default completions")
    g.add_argument("--backend", type=_choice(BACKENDS, "backend"), default=None,
                   help="vLLM's spelling of the endpoint: openai or vllm (completions), openai-chat (chat)")
    g.add_argument("--tokenizer", default=None,
                   help="accepted for vLLM command lines; token counts come from the server (usage, /tokenize)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", type=_choice(DATASET_NAMES, "dataset"),
                   default="random", help="random | shared-prefix (vLLM: prefix_repetition) | jsonl (vLLM: custom) | "
                                          "sharegpt | repetitive (repeat a code snippet with one change: "
                                          "where speculative decoding pays); default random")
    d.add_argument("--num-prompts", type=_positive_int, default=100)
    d.add_argument("--input-len", "--random-input-len", "--prefix-repetition-suffix-len", dest="input_len",
                   type=int, default=256, help="prompt tokens (shared-prefix: tokens after the prefix); default 256")
    d.add_argument("--output-len", "--random-output-len", "--prefix-repetition-output-len", dest="output_len",
                   type=_positive_int, default=128, help="max_tokens per request (default 128)")
    d.add_argument("--sharegpt-output-len", type=_positive_int, default=None,
                   help="sharegpt: max_tokens of every request (default: the length of the dataset's reply)")
    d.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)] (default 0: fixed)")
    d.add_argument("--num-groups", "--prefix-repetition-num-prefixes", dest="num_groups", type=_positive_int,
                   default=1, help="shared-prefix: number of distinct prefixes (default 1)")
    d.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=1000,
                   help="shared-prefix: prefix tokens (default 1000)")
    d.add_argument("--dataset-path", default=None,
                   help='jsonl: one {"prompt": ...} per line (optional "system", "output_len"); '
                        'sharegpt: a JSON list of {"conversations": [...]}')
    d.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="do not ask the server's /tokenize how many tokens the random words make")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")

    lg = p.add_argument_group("load")
    lg.add_argument("--max-concurrency", type=_positive_int, default=None,
                    help="at most this many requests in flight (default: no limit)")
    lg.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second (default inf: all at once, limited by --max-concurrency)")
    lg.add_argument("--burstiness", type=float, default=1.0,
                    help="shape of the gamma inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier")
    lg.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos so every request generates exactly its max_tokens")
    lg.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    lg.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="first send N extra requests of the same kind one at a time, not counted (e.g. to fill "
                         "a prefix cache with the shared prefix); default 0")
    lg.add_argument("--sweep", type=_concurrency_list, default=None, metavar="C1,C2,...",
                    help="run once per max concurrency in this list, e.g. 1,4,16,64")

    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS",
                   help="goodput: requests/s meeting every limit (keys ttft, tpot, e2el; milliseconds)")
    o.add_argument("--goodput", type=_goodput, nargs="+", default=None, metavar="KEY:MS",
                   help="vLLM's spelling of --slo, e.g. --goodput ttft:500 tpot:50")
    o.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write the configuration, the summaries and per-request records as JSON")
    o.add_argument("--save-result", action="store_true",
                   help="write the JSON results to --result-dir/--result-filename (vLLM's flags)")
    o.add_argument("--result-dir", default=".", help="with --save-result: folder (default .)")
    o.add_argument("--result-filename", default=None,
                   help="with --save-result: file name (default tokenloom-bench-{dataset}-{date}.json)")
    for flag in ("--percentile-metrics", "--metric-percentiles"):
        o.add_argument(flag, action=_Refused, reason="not supported: the report always gives mean, p50, p90 and p99")
    o.add_argument("--plot", default=None, metavar="FILE.png",
                   help="with --sweep: plot output tokens/s against TTFT p50 and TPOT p50")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve_bench)


# ---------------------------------------------------------------------------------- server

def api_base(base_url: str) -> tuple[str, str]:
    """(server root, OpenAI base ending in /v1) from a URL given with or without /v1."""
    url = base_url.rstrip("/")
    root = url[:-3] if url.endswith("/v1") else url
    return root, root + "/v1"


def fetch_model(client: httpx.Client, api: str) -> JsonObject:
    resp = client.get(api + "/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"GET {api}/models listed no models; pass --model")
    return data[0]


def count_tokens(client: httpx.Client, root: str, model: str, text: str) -> int | None:
    """Token count of ``text`` from the server's /tokenize (vLLM/tokenloom shape, then
    llama.cpp's), or None where there is no such endpoint."""
    for body in ({"model": model, "prompt": text, "add_special_tokens": False}, {"content": text}):
        try:
            resp = client.post(root + "/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            continue
        try:
            obj = resp.json()
        except ValueError:
            continue
        if isinstance(obj.get("count"), int):
            return obj["count"]
        if isinstance(obj.get("tokens"), list):
            return len(obj["tokens"])
    return None


def calibrate_tokens_per_word(client: httpx.Client, root: str, model: str, seed: int = 12345,
                              words: int = 1000) -> float | None:
    text = datasets.random_text(random.Random(seed), words, 1.0)
    n = count_tokens(client, root, model, text)
    return (n / words) if n else None


def resolve_vllm_aliases(ns: argparse.Namespace) -> list[str]:
    """Fold vLLM's flags into ours (in place); returns notes for the user."""
    notes = []
    if ns.host or ns.port:
        if ns.base_url != DEFAULT_BASE_URL:
            raise ValueError("give either --base-url or --host/--port")
        ns.base_url = f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}"
    if ns.backend and ns.endpoint == "completions":
        ns.endpoint = ns.backend
    if ns.goodput:
        ns.slo = ",".join(([ns.slo] if ns.slo else []) + ns.goodput)
    if ns.save_result and not ns.json_path:
        name = ns.result_filename or f"tokenloom-bench-{ns.dataset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        ns.json_path = os.path.join(ns.result_dir, name)
    if ns.tokenizer:
        notes.append("note: --tokenizer is not used: token counts come from the server (usage, /tokenize)")
    if ns.dataset == "sharegpt" and not ns.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
    return notes


def build_prompts(ns: argparse.Namespace, tokens_per_word: float) -> list[BenchPrompt]:
    if ns.dataset == "random":
        return datasets.random_dataset(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.seed,
                                       tokens_per_word)
    if ns.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(ns.num_prompts, ns.num_groups, ns.prefix_len, ns.input_len,
                                              ns.output_len, ns.range_ratio, ns.seed, tokens_per_word)
    if ns.dataset == "repetitive":
        return datasets.repetitive_dataset(ns.num_prompts, ns.output_len, ns.seed)
    if ns.dataset == "sharegpt":
        # Real text runs about 1.3 tokens a word; the calibration measures the random words only.
        return datasets.sharegpt_dataset(ns.dataset_path, ns.num_prompts, ns.sharegpt_output_len, ns.seed)
    if not ns.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    return datasets.jsonl_dataset(ns.dataset_path, ns.num_prompts, ns.output_len, ns.range_ratio, ns.seed,
                                  tokens_per_word, start=getattr(ns, "sweep_index", 0) * ns.num_prompts)


# ---------------------------------------------------------------------------------- load

def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: gamma-distributed gaps with
    shape ``burstiness`` and mean 1/rate (exponential, i.e. Poisson arrivals, at 1); all
    zero for an infinite rate."""
    if request_rate == math.inf or request_rate <= 0:
        return [0.0] * n
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


_Item = TypeVar("_Item")


async def _schedule(items: Sequence[_Item], offsets: Sequence[float], t0: float) -> AsyncIterator[_Item]:
    for item, at in zip(items, offsets):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item


async def run_load(prompts: Sequence[BenchPrompt], *, api: str, endpoint: str, model: str,
                   max_concurrency: int | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                   seed: int = 0, ignore_eos: bool = False, temperature: float = 0.0,
                   headers: dict[str, str] | None = None, timeout: float = 600.0, progress: bool = True,
                   desc: str = "requests", transport: httpx.AsyncBaseTransport | None = None,
                   lora_modules: Sequence[str] = (),
                   ) -> tuple[list[RequestResult], float]:
    """Send every prompt; return the results (in prompt order) and the wall time (s). With `lora_modules`,
    prompt i names adapter i mod N instead of `model`, so a run spreads evenly over the adapters."""
    url = api + ENDPOINTS[endpoint]
    conns = max_concurrency or len(prompts)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    offsets = arrival_offsets(len(prompts), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
    results: list[RequestResult | None] = [None] * len(prompts)
    failures = 0

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
                                 trust_env=False, transport=transport) as client:
        async def one(i: int, t0: float) -> None:
            nonlocal failures
            p = prompts[i]
            name = lora_modules[i % len(lora_modules)] if lora_modules else model
            payload = build_payload(endpoint, name, p, ignore_eos, temperature)
            if sem is not None:
                async with sem:
                    r = await send_request(client, url, payload, headers, t0)
            else:
                r = await send_request(client, url, payload, headers, t0)
            r.expected_input_len, r.expected_output_len = p.input_len, p.output_len
            results[i] = r
            if bar is not None:
                failures += not r.success
                bar.update(1)
                if failures:
                    bar.set_postfix(failed=failures)

        t0 = time.perf_counter()
        tasks = []
        async for i in _schedule(range(len(prompts)), offsets, t0):
            tasks.append(asyncio.create_task(one(i, t0)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return [r for r in results if r is not None], duration


# ---------------------------------------------------------------------------------- main

def run_serve_bench(ns: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request

    try:
        for note in resolve_vllm_aliases(ns):
            print(note, file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        slo = report.parse_slo(ns.slo)
    except ValueError as e:
        print(f"error: --slo: {e}", file=sys.stderr)
        return 2
    if ns.plot and not ns.sweep:
        print("note: --plot draws a --sweep; with a single run it shows one point", file=sys.stderr)
    root, api = api_base(ns.base_url)
    key = ns.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    with httpx.Client(timeout=30.0, headers=headers, trust_env=False) as client:
        model, max_len = ns.model, None
        try:  # also with --model: the card may tell max_model_len
            card = fetch_model(client, api)
            model = model or card["id"]
            if card["id"] == model:
                max_len = card.get("max_model_len")
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            if model is None:
                print(f"error: cannot list the models at {api}/models: {e}", file=sys.stderr)
                return 2
        tpw = None
        if ns.calibrate and ns.dataset in ("random", "shared-prefix"):
            tpw = calibrate_tokens_per_word(client, root, model)
    if ns.warmup < 0 or not ns.request_rate > 0 or not ns.burstiness > 0:
        print("error: --warmup must be >= 0, --request-rate and --burstiness > 0", file=sys.stderr)
        return 2
    concurrencies: list[int | None] = list(ns.sweep) if ns.sweep else [ns.max_concurrency]
    if len(concurrencies) > 1:
        print(f"sweep: each point gets fresh prompts (seed {ns.seed} + the point's index), so none is served "
              f"from prefixes an earlier point cached", file=sys.stderr)
    runs, details = [], []
    for k, c in enumerate(concurrencies):
        try:  # warm-up requests come from the same generator (same shared prefixes), after the measured ones
            everything = build_prompts(argparse.Namespace(**dict(vars(ns), num_prompts=ns.num_prompts + ns.warmup,
                                                                 seed=ns.seed + k, sweep_index=k)), tpw or 1.0)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        prompts, warmup = everything[:ns.num_prompts], everything[ns.num_prompts:]
        if k == 0:
            longest = max(p.input_len + p.output_len for p in prompts)
            print(f"tokenloom bench serve: {len(prompts)} {ns.dataset} prompts -> {api}{ENDPOINTS[ns.endpoint]} "
                  f"(model {model}); "
                  + (f"{tpw:.3f} tokens/word from /tokenize" if tpw else "no /tokenize calibration, ~1 token/word"),
                  file=sys.stderr)
            if isinstance(max_len, int) and longest > max_len:
                print(f"warning: the longest request needs ~{longest} tokens, more than the server's "
                      f"max_model_len {max_len}", file=sys.stderr)
        if warmup:
            wres, _ = asyncio.run(run_load(warmup, api=api, endpoint=ns.endpoint, model=model, max_concurrency=1,
                                           seed=ns.seed, ignore_eos=ns.ignore_eos, temperature=ns.temperature,
                                           headers=headers, timeout=ns.request_timeout, progress=False,
                                           lora_modules=ns.lora_modules))
            bad = [r for r in wres if not r.success]
            print(f"warm-up: {len(wres) - len(bad)}/{len(wres)} requests succeeded"
                  + (f" (first error: {bad[0].error})" if bad else ""), file=sys.stderr)
        spec_before = fetch_spec_counters(root, headers)
        results, duration = asyncio.run(run_load(
            prompts, api=api, endpoint=ns.endpoint, model=model, max_concurrency=c,
            request_rate=ns.request_rate, burstiness=ns.burstiness, seed=ns.seed, ignore_eos=ns.ignore_eos,
            temperature=ns.temperature, headers=headers, timeout=ns.request_timeout,
            progress=not ns.disable_tqdm, desc=f"concurrency {c if c else 'inf'}", lora_modules=ns.lora_modules))
        s = report.summarize(results, duration, slo, max_concurrency=c, request_rate=ns.request_rate,
                             burstiness=ns.burstiness)
        spec_after = fetch_spec_counters(root, headers)
        if spec_before is not None and spec_after is not None:
            s.update(spec_decode_stats(spec_before, spec_after))
        runs.append(s)
        details.append(report.requests_detail(results))
        print(report.format_summary(s), flush=True)
    if len(runs) > 1:
        print(report.format_sweep(runs), flush=True)
    if ns.plot:
        report.plot_sweep(runs, ns.plot, title=f"{model} ({ns.dataset}, {ns.endpoint})")
        print(f"plot written to {ns.plot}", file=sys.stderr)
    if ns.json_path:
        config = {k: v for k, v in vars(ns).items() if k != "func" and not k.startswith("_")}
        config.update(model=model, api_base=api, tokens_per_word=tpw, api_key="(set)" if key else None)
        doc = {"config": config, "runs": [dict(s, requests=d) for s, d in zip(runs, details)]}
        with open(ns.json_path, "w", encoding="utf-8") as f:
            json.dump(_json_safe(doc), f, indent=2)
        print(f"results written to {ns.json_path}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in runs) else 1


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def fetch_spec_counters(root: str, headers: dict) -> dict[str, float] | None:
    """The server's speculative-decoding counters from /metrics (vLLM's names), or None without speculation
    or without a /metrics endpoint."""
    try:
        text = httpx.get(root + "/metrics", headers=headers, timeout=10.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in SPEC_COUNTERS:
            for prefix in ("tokenloom:", "vllm:"):
                if line.startswith(prefix + name + "_total") or line.startswith(prefix + name + "{"):
                    if line.startswith(prefix + name + "_per_pos"):
                        continue
                    found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found or None


def spec_decode_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance rate and mean accepted length (tokens per verify span, the bonus token included) over a run."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts, tokens, accepted = (d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"],
                                d["spec_decode_num_accepted_tokens"])
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / tokens if tokens else float("nan"),
            "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else float("nan")}


def _json_safe(obj: JsonValue) -> JsonValue:
    """NaN/inf become null or the string "inf" so the file is strict JSON."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
