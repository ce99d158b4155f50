"""Statistics, goodput, the text report and the sweep plot of `tokenloom bench serve`.

All latencies in the summaries are in milliseconds; throughputs per second of wall time
from the first request sent to the last one finished.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from tokenloom.bench.client import RequestResult
from tokenloom.core.json_types import JsonObject, JsonValue

PERCENTILES = (50, 90, 99)
METRICS = (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
           ("itl", "Inter-token latency"), ("e2el", "End-to-end latency"))
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (as
    numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def describe(values: Sequence[float]) -> dict[str, float]:
    """mean and percentiles of ``values`` (NaN when empty)."""
    out = {"mean": (sum(values) / len(values)) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds). Keys: ttft, tpot, e2el."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY one of ttft, tpot, e2el")
        try:
            ms = float(value.strip().removesuffix("ms"))
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"bad SLO {part!r}: must be positive")
        out[SLO_KEYS[key]] = ms
    return out


def request_metrics_ms(r: RequestResult) -> dict[str, float | None]:
    tpot = r.tpot
    return {"ttft": r.ttft * 1e3, "tpot": None if tpot is None else tpot * 1e3, "e2el": r.latency * 1e3}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """A successful request meets the SLO when each named metric is at most its limit (a
    request with under 2 output tokens has no TPOT, which counts as met)."""
    if not r.success:
        return False
    m = request_metrics_ms(r)
    return all(m[k] is None or m[k] <= limit for k, limit in slo.items())


def summarize(results: Sequence[RequestResult], duration: float, slo: dict[str, float] | None = None,
              **meta: JsonValue) -> JsonObject:
    """One run's numbers as a JSON-ready dict (latencies in ms)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration = max(duration, 1e-9)
    in_tok = sum(r.prompt_tokens if r.usage_reported else r.expected_input_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    s: JsonObject = dict(meta)
    s.update({
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "cached_input_tokens": sum(cached) if cached else None,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
    })
    per = [request_metrics_ms(r) for r in ok]
    s["ttft_ms"] = describe([m["ttft"] for m in per])
    s["tpot_ms"] = describe([m["tpot"] for m in per if m["tpot"] is not None])
    s["itl_ms"] = describe([x * 1e3 for r in ok for x in r.itl])
    s["e2el_ms"] = describe([m["e2el"] for m in per])
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        s["slo_ms"] = dict(slo)
        s["good_requests"] = good
        s["goodput"] = good / duration
    return s


def requests_detail(results: Iterable[RequestResult]) -> list[JsonObject]:
    """Per-request records for the JSON file (times in ms)."""
    out = []
    for r in results:
        m = request_metrics_ms(r)
        out.append({"success": r.success, "error": r.error or None, "start_ms": r.start * 1e3,
                    "ttft_ms": m["ttft"] if r.success else None, "tpot_ms": m["tpot"] if r.success else None,
                    "e2el_ms": m["e2el"], "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                    "cached_tokens": r.cached_tokens})
    return out


def _fmt(v: JsonValue, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def format_summary(s: JsonObject, title: str = "Serving benchmark") -> str:
    w = 44
    lines = [f"{' ' + title + ' ':=^{w + 16}}"]

    def row(label: str, value: JsonValue, digits: int = 2) -> None:
        lines.append(f"{label:<{w}}{_fmt(value, digits):>16}")

    if s.get("max_concurrency") is not None:
        row("Max concurrency:", s["max_concurrency"])
    if s.get("request_rate") is not None:
        row("Request rate (req/s):", s["request_rate"] if s["request_rate"] != math.inf else "inf")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    if s.get("cached_input_tokens") is not None:
        row("  of which cached (server-reported):", s["cached_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if "goodput" in s:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo_ms"].items())
        row(f"Goodput (req/s, {slo}):", s["goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, label in METRICS:
        d = s[f"{key}_ms"]
        lines.append(f"{' ' + label + ' ':-^{w + 16}}")
        row(f"Mean {key.upper()} (ms):", d["mean"])
        for q in PERCENTILES:
            row(f"P{q} {key.upper()} (ms):", d[f"p{q}"])
    if s.get("spec_decode_num_drafts"):
        lines.append(f"{' Speculative Decoding ':-^{w + 16}}")
        row("Acceptance rate (%):", 100 * s["spec_decode_acceptance_rate"])
        row("Acceptance length:", s["spec_decode_mean_accepted_length"])
        row("Drafts:", int(s["spec_decode_num_drafts"]))
        row("Draft tokens:", int(s["spec_decode_num_draft_tokens"]))
        row("Accepted tokens:", int(s["spec_decode_num_accepted_tokens"]))
    if s.get("usage_missing"):
        lines.append(f"note: {s['usage_missing']} response(s) had no usage; their output tokens are chunk counts")
    if s.get("first_error"):
        lines.append(f"first error: {s['first_error']}")
    lines.append("=" * (w + 16))
    return "\n".join(lines)


def format_sweep(runs: Sequence[JsonObject]) -> str:
    """One line per concurrency of a sweep."""
    head = (f"{'conc':>6} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'E2E p50':>9}")
    lines = [head, "-" * len(head)]
    for s in runs:
        c = s.get("max_concurrency")
        lines.append(f"{_fmt(c) if c is not None else 'inf':>6} {s['completed']:>5} {s['failed']:>5} "
                     f"{s['request_throughput']:>8.2f} {s['output_throughput']:>10.1f} "
                     f"{s['total_token_throughput']:>10.1f} {s['ttft_ms']['p50']:>9.1f} {s['ttft_ms']['p99']:>9.1f} "
                     f"{s['tpot_ms']['p50']:>9.1f} {s['tpot_ms']['p99']:>9.1f} {s['e2el_ms']['p50']:>9.1f}")
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def plot_sweep(runs: Sequence[JsonObject], path: str, title: str | None = None) -> None:
    """Output tokens/s against TTFT p50 and against TPOT p50, one point per concurrency."""
    import matplotlib  # lazy: matplotlib takes ~0.5 s to import, for a plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    thr = [s["output_throughput"] for s in runs]
    labels = [str(s.get("max_concurrency") if s.get("max_concurrency") is not None else "inf") for s in runs]
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT p50 (ms)"), (axes[1], "tpot_ms", "TPOT p50 (ms)")):
        xs = [s[key]["p50"] for s in runs]
        ax.plot(xs, thr, marker="o")
        for x, y, lab in zip(xs, thr, labels):
            ax.annotate(f"c={lab}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel("output tokens/s")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "tokenloom bench serve: throughput vs latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
