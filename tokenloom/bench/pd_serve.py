"""`python -m tokenloom.bench.pd_serve`: TTFT and TPOT of a prefill/decode pair against one mixed instance,
under the same prefill-heavy load (long distinct prompts, short answers), one after the other in one run.

PD requests go through `tokenloom.router.pd.pd_request` (what `tokenloom router --pd` runs); mixed ones
straight to the mixed server. TTFT is the time to the first streamed token as the client sees it (for PD:
the prefill round trip, the KV pull and the decoder's first chunk); TPOT is (last - first) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from tokenloom.router.pd import pd_request

WORDS = ("river stone cloud market engine garden signal winter copper lantern harbor velvet orbit meadow "
         "canvas thunder ledger prism falcon quartz").split()


def prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummarise the document."


async def one(client: httpx.AsyncClient, body: dict, mixed: str | None, prefill: str, decode: str) -> tuple:
    start = time.perf_counter()
    if mixed:
        response = await client.send(client.build_request("POST", mixed + "/v1/completions", json=body), stream=True)
    else:
        response = await pd_request(client, "/v1/completions", body, prefill, decode)
    stamps = []
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server answered an error: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    finally:
        await response.aclose()
    ttft = stamps[0] - start
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return ttft, tpot


async def load(args, mixed: str | None) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(i):
            body = {"model": args.model, "prompt": prompt(i + (0 if mixed else 10_000), args.words),
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            async with sem:
                return await one(client, body, mixed, args.prefill, args.decode)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    ttfts, tpots = [r[0] for r in results], [r[1] for r in results]
    return {"setup": "mixed" if mixed else "PD 1P1D", "requests": args.requests, "wall_s": wall,
            "ttft_median_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts),
            "tpot_median_ms": 1e3 * statistics.median(tpots), "tpot_max_ms": 1e3 * max(tpots)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed", required=True, help="base URL of the mixed instance")
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--words", type=int, default=600, help="prompt length in words (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    rows = [asyncio.run(load(args, args.mixed)), asyncio.run(load(args, None))]
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
