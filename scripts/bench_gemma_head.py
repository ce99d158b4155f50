"""Gemma 3 270M's output head: its Q8_0 blocks (what the engine multiplies by with the native kernels) against
a float32 copy of them (what it multiplied by before the blocks were kept: the dequantized tied embedding,
prepacked for oneDNN).

One engine (uni executor, so the model is in this process), `--batch` requests decoding past a `--context`
prompt; the head is switched between the two forms every `--steps` decode steps, for `--rounds` rounds, so
both see the same machine load. Prints the median decode step of each form, their ratio, the head's matmul
alone (interleaved the same way), the bytes of each head and the process RSS before and after the float32 copy
is built.

    .venv/bin/python scripts/bench_gemma_head.py --batch 1 --context 64 --steps 8 --rounds 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.config import EngineConfig
from tokenloom.engine.core import EngineCore
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.model.layers.linear_method import mixed_linear
from tokenloom.model.layers.quantized_weight import QuantizedWeight
from tokenloom.model.prepack import can_prepack, pack_weight
from tokenloom.sampling_params import SamplingParams


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _head_alone(forms: dict, batch: int, rounds: int, repeats: int = 5) -> dict[str, float]:
    """Median ms of [batch, hidden] x head^T for each form, the forms interleaved."""
    x = torch.randn(batch, next(iter(forms.values())).shape[1])
    times: dict[str, list[float]] = {name: [] for name in forms}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, head in forms.items():
                mixed_linear(x, head)
                start = time.perf_counter()
                for _ in range(repeats):
                    mixed_linear(x, head)
                times[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per form per round")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    core = EngineCore(EngineConfig.from_kwargs(model="gemma3-270m", dtype="float32", device="cpu",
                                               log_stats_interval=0, kv_cache_memory=0.5), progress=False)
    model = core.executor.worker.runner.model
    blocks = model.head_weight()
    if not isinstance(blocks, QuantizedWeight):
        raise SystemExit("the head is not quantized here (native kernels off?): nothing to compare")
    rss_blocks = rss_mib()
    dense = blocks.dequantize()
    dense = pack_weight(dense) if can_prepack(torch.device("cpu")) else dense
    rss_dense = rss_mib()

    total = args.context + args.steps * args.rounds * 2 + 4
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(100, 200_000, (args.context,), generator=g).tolist()
        core.add_request(EngineCoreRequest(request_id=f"b{i}", prompt_token_ids=prompt, sampling_params=params,
                                           arrival_time=time.time(), priority=0, eos_token_ids=[1]))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()) \
            or core.scheduler.waiting:
        core.step()
    forms = {"Q8_0 blocks": None, "float32 copy": dense}  # tied_head_weight None: the embedding's own blocks
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, head in forms.items():
            model.tied_head_weight = head
            core.step()  # one untimed step after the switch
            for _ in range(args.steps):
                start = time.perf_counter()
                core.step()
                times[name].append(time.perf_counter() - start)
    model.tied_head_weight = None
    core.shutdown()
    head_ms = _head_alone(forms | {"Q8_0 blocks": blocks}, args.batch, args.rounds)

    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"batch {args.batch}, context {args.context}, {args.rounds} rounds x {args.steps} steps per form")
    for name in forms:
        print(f"  {name:>13}: decode step median {med[name]:8.1f} ms")
    print(f"  float32 / Q8_0 step: {med['float32 copy'] / med['Q8_0 blocks']:.2f}x")
    for name in forms:
        print(f"  {name:>13}: the head's matmul alone, median {head_ms[name]:8.1f} ms")
    print(f"  float32 / Q8_0 head: {head_ms['float32 copy'] / head_ms['Q8_0 blocks']:.2f}x")
    print(f"  head bytes: Q8_0 {blocks.nbytes / 2 ** 20:.0f} MiB (shared with the lookup), float32 "
          f"{blocks.shape.numel() * 4 / 2 ** 20:.0f} MiB (a copy beside it)")
    print(f"  RSS: {rss_blocks:.0f} MiB with the blocks, {rss_dense:.0f} MiB once the float32 copy exists "
          f"(+{rss_dense - rss_blocks:.0f} MiB)")


if __name__ == "__main__":
    main()
