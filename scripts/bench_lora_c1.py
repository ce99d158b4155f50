"""An adapter's cost at concurrency 1 on a running server: base-model and adapter requests alternating, one
at a time, so a drift in the machine's load falls on both alike (on a shared 2-core machine the base model's
own TPOT moves by 10% from one minute to the next, more than the difference measured).

Each request streams a completion of --max-tokens tokens (greedy, ignore_eos) from a prompt of random common
words; its TPOT is (last token's arrival - first's) / (tokens - 1). Prints the medians and their ratio.

Usage: .venv/bin/python scripts/bench_lora_c1.py [--base-url http://127.0.0.1:8765] [--requests 24]
           [--model smollm2-135m-instruct] [--adapters a0 a1 a2 a3] [--max-tokens 64]
"""
import argparse
import random
import statistics
import time

import httpx

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8765")
parser.add_argument("--requests", type=int, default=24, help="of each kind")
parser.add_argument("--model", default="smollm2-135m-instruct", help="the base model's name")
parser.add_argument("--adapters", nargs="+", default=["a0", "a1", "a2", "a3"], help="taken in turn")
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--warm-up", type=int, default=4, help="requests of each kind first, not counted")
args = parser.parse_args()

WORDS = ("the cat sat on a mat and looked at the sky while birds flew over fields of green grass near an old "
         "stone wall by the river").split()
rng = random.Random(0)


def tpot_ms(client: httpx.Client, model: str) -> float:
    prompt = " ".join(rng.choice(WORDS) for _ in range(60))
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals = []
    with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1000


with httpx.Client(timeout=120) as client:
    for i in range(args.warm_up):
        tpot_ms(client, args.model)
        tpot_ms(client, args.adapters[i % len(args.adapters)])
    base, adapter = [], []
    for i in range(args.requests):
        base.append(tpot_ms(client, args.model))
        adapter.append(tpot_ms(client, args.adapters[i % len(args.adapters)]))
b, a = statistics.median(base), statistics.median(adapter)
print(f"concurrency 1, median TPOT over {args.requests} requests each: base {b:.2f} ms, "
      f"adapter {a:.2f} ms ({a / b:.3f}x)")
