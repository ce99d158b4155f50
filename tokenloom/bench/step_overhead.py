"""`python -m tokenloom.bench.step_overhead`: where a batch-1 decode step's time goes outside the kernels.

One request of `--context` random tokens decodes (greedy, ignore_eos) in an EngineCore in this process;
after its prefill, `--steps` steps are timed (median), then `--profile-steps` more run under
torch.profiler. The report splits the profiled steps into the top-level ops the main thread ran (each with
its calls and microseconds a step) and the rest of the step, which is Python: the model's layers, the
runner's inputs and sampling, the scheduler. The profiler's own cost inflates that rest (by ~2x here), so
read its op rows and the unprofiled median side by side. `--threads N` sets torch's thread count; the other
arguments are the engine's (`--quantized-matmul w4a8`, `--attention-backend torch`...).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from tokenloom.config import EngineConfig, add_engine_args
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore


def _fill(core, context: int) -> None:
    prompt = torch.randint(100, core.info.vocab_size - 100, (context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="step-overhead", prompt_token_ids=prompt, sampling_params=params,
                                       arrival_time=time.time()))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()


def _median_step_ms(core, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def _top_level_ops(core, steps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(profiled step ms, {op: (calls a step, us a step)}) for the ops the stepping thread ran outermost."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("engine_step"):
                core.step()
    events = [e for e in prof.events() if e.thread == next(s.thread for s in prof.events() if s.name == "engine_step")]
    events.sort(key=lambda e: e.time_range.start)
    wall = sum(e.time_range.elapsed_us() for e in events if e.name == "engine_step")
    per_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    end = -1
    for e in events:
        if e.name == "engine_step" or e.time_range.start < end:
            continue
        per_op[e.name][0] += 1
        per_op[e.name][1] += e.time_range.elapsed_us()
        end = e.time_range.end
    return wall / steps / 1e3, {name: (calls / steps, us / steps) for name, (calls, us) in per_op.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", dest="model", default=None)
    p.add_argument("--context", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed without the profiler (median)")
    p.add_argument("--profile-steps", type=int, default=20, help="decode steps under torch.profiler (0: none)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    add_engine_args(p, model_positional=False)
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    core = EngineCore(EngineConfig.from_args(ns))
    try:
        _fill(core, ns.context)
        _median_step_ms(core, 5)  # warm
        print(f"batch-1 decode step at context {ns.context}: median {_median_step_ms(core, ns.steps):.2f} ms "
              f"over {ns.steps} steps, {torch.get_num_threads()} threads")
        if ns.profile_steps:
            step_ms, ops = _top_level_ops(core, ns.profile_steps)
            in_ops = sum(us for _, us in ops.values()) / 1e3
            print(f"under torch.profiler: {step_ms:.2f} ms a step = {in_ops:.2f} ms in top-level ops "
                  f"+ {step_ms - in_ops:.2f} ms outside them (Python, profiler included)")
            print(f"{'us/step':>9} {'calls':>6}  op")
            for name, (calls, us) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
                print(f"{us:9.1f} {calls:6.1f}  {name}")
    finally:
        core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
