"""`tokenloom bench decode`: the time of one decode step at given batch sizes, on any model and any
tensor-parallel size (the EngineCore alone: token ids in, no tokenizer needed).

Each batch size fills the engine with that many random prompts, runs their prefill (its time and tokens/s
reported beside, the figure for a long context), then times pure decode steps and reports the median. This
is the figure the tensor-parallel cost model predicts.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.config import EngineConfig, add_engine_args
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", dest="model", default=None)
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated decode batch sizes (default 1,32)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per batch size (median reported)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    add_engine_args(p, model_positional=False)
    p.set_defaults(func=run_decode)


@dataclass
class DecodeTiming:
    prefill_s: float  # the batch's prompts, to their first token
    step_ms: float  # median pure decode step


def decode_step_ms(core: EngineCore, batch: int, context: int, steps: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time (on `clock`: wall time by default) of a pure decode step with `batch` sequences of `context`
    random prompt tokens (their prefill run first, and the requests finished after)."""
    return time_decode(core, batch, context, steps, clock).step_ms


def time_decode(core: EngineCore, batch: int, context: int, steps: int,
                clock: Callable[[], float] = time.perf_counter) -> DecodeTiming:
    """The prefill of `batch` prompts of `context` random tokens, then the median of `steps` decode steps."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    prompts = torch.randint(100, core.info.vocab_size - 100, (batch, context)).tolist()
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"b{batch}-{i}-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                           sampling_params=params, arrival_time=time.time()))
    start = clock()
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    prefill_s = clock() - start
    times = []
    for _ in range(steps):
        start = clock()
        core.step()
        times.append(clock() - start)
    while core.has_unfinished_requests():
        core.step()
    return DecodeTiming(prefill_s, 1e3 * sorted(times)[len(times) // 2])


def run_decode(ns) -> int:
    config = EngineConfig.from_args(ns)
    core = EngineCore(config)
    results = {"tensor_parallel_size": config.parallel.tensor_parallel_size, "context": ns.context, "step_ms": {},
               "prefill_tokens_per_s": {}}
    try:
        for batch in (int(b) for b in ns.batch_sizes.split(",")):
            timing = time_decode(core, batch, ns.context, ns.steps)
            results["step_ms"][batch] = timing.step_ms
            results["prefill_tokens_per_s"][batch] = batch * ns.context / timing.prefill_s
            print(f"prefill of {batch} x {ns.context} tokens: {timing.prefill_s:.1f} s "
                  f"({results['prefill_tokens_per_s'][batch]:.1f} tokens/s)", flush=True)
            print(f"decode step at batch {batch}, context {ns.context}, tp {config.parallel.tensor_parallel_size}: "
                  f"{timing.step_ms:.1f} ms", flush=True)
    finally:
        core.shutdown()
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
