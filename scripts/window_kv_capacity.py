"""How many long requests a sliding-window model keeps running in one KV cache: with the blocks behind
the window freed (tokenloom's default when every layer is windowed, as in Mistral) against kept (as
before blocks were freed behind the window), side by side in one run.

The model is a tiny random Mistral-shaped one (2 layers, window 512) so that its speed hardly matters:
what is measured is the real engine's block accounting (scheduler, KV cache manager, block pool) under
one workload. Needs the test extras (transformers builds the model).

    .venv/bin/python scripts/window_kv_capacity.py [--requests 32] [--prompt-len 2048] [--num-blocks 1024]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

from tokenloom.config import EngineConfig
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.scheduler.kv_cache_manager import KVCacheManager


def tiny_mistral(folder: str, window: int, context: int) -> str:
    config = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                        max_position_embeddings=context)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def run(folder: str, args, release: bool) -> dict:
    core = EngineCore(EngineConfig.from_kwargs(
        model=folder, device="cpu", dtype="float32", num_blocks=args.num_blocks, block_size=16,
        max_num_seqs=args.requests, max_num_batched_tokens=512, log_stats_interval=0), progress=False)
    if not release:  # the accounting without the window release: every block kept until the request ends
        core.kv_manager = core.scheduler.kv = KVCacheManager(args.num_blocks, 16, True, None)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.requests):
        prompt = torch.randint(3, 512, (args.prompt_len,), generator=g).tolist()
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params,
                                           arrival_time=time.time()))
    peak_running = peak_blocks = steps = tokens = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in core.step())
        steps += 1
        peak_running = max(peak_running, len(core.scheduler.running))
        peak_blocks = max(peak_blocks, core.kv_manager.pool.num_used)
    seconds = time.perf_counter() - start
    return dict(release=release, peak_running=peak_running, peak_blocks=peak_blocks, steps=steps,
                seconds=seconds, preemptions=core.scheduler.num_preemptions, output_tokens=tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of 16 tokens")
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_mistral(tmp, args.window, 4 * args.prompt_len)
        results = [run(folder, args, release) for release in (False, True)]
    print(f"{args.requests} requests of {args.prompt_len} + {args.output_len} tokens, window {args.window}, "
          f"{args.num_blocks} blocks of 16 tokens")
    print("blocks behind the window | peak running requests | peak blocks used | steps | preemptions | seconds")
    for r in results:
        print(f"{'freed' if r['release'] else 'kept':>24} | {r['peak_running']:>21} | {r['peak_blocks']:>16} | "
              f"{r['steps']:>5} | {r['preemptions']:>11} | {r['seconds']:.1f}")


if __name__ == "__main__":
    main()
