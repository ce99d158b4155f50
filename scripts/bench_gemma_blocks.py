"""Gemma 3 270M's quantized weights against float32 copies of them, in one engine, interleaved.

`--what head`: the output head as the file's Q8_0 blocks (the tied embedding's, what the engine multiplies
by with the native kernels) or as a oneDNN-packed float32 copy (what it multiplied by before the blocks
were kept). `--what q5_0`: the merged q/k/v and gate/up layers (the file's Q5_0 tensors, with a Q8_0 v in
half the layers) as repacked 8-bit blocks or as packed float32 (how they loaded before Q5_0 was repacked).

One engine (uni executor, so the model is in this process), `--batch` requests decoding past a `--context`
prompt; the two forms are switched every `--steps` decode steps for `--rounds` rounds, so both see the same
machine load. Prints the median decode step of each form and their ratio, then the same layers' matmuls
alone (interleaved the same way), the bytes of each form and the process RSS before and after the float32
copies are built. TOKENLOOM_WEIGHT_CACHE=0 keeps it from writing the weight cache.

    TOKENLOOM_WEIGHT_CACHE=0 .venv/bin/python scripts/bench_gemma_blocks.py --what head --batch 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.model.layers.linear_method import UNQUANTIZED, mixed_linear
from tokenloom.model.layers.quantized_linear import QUANTIZED
from tokenloom.model.layers.quantized_weight import QuantizedWeight
from tokenloom.model.prepack import can_prepack, pack_weight


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _float32(weight: QuantizedWeight) -> torch.Tensor:
    dense = weight.dequantize()
    return pack_weight(dense) if can_prepack(torch.device("cpu")) else dense


class HeadForms:
    """The tied head: None in tied_head_weight multiplies by the embedding's own blocks."""

    def __init__(self, model):
        self.model = model
        self.blocks = model.head_weight()
        self.weights = {"blocks": [self.blocks]}

    def build_float32(self):
        self.dense = _float32(self.blocks)
        self.weights["float32"] = [self.dense]

    def use(self, form: str) -> None:
        self.model.tied_head_weight = None if form == "blocks" else self.dense


class LayerForms:
    """Linear layers, each switched between its blocks (QUANTIZED) and a float32 copy (UNQUANTIZED)."""

    def __init__(self, model, suffixes: tuple[str, ...]):
        self.layers = [m for name, m in model.named_modules() if name.endswith(suffixes)]
        self.weights = {"blocks": [m.weight for m in self.layers]}

    def build_float32(self):
        self.weights["float32"] = [_float32(w) for w in self.weights["blocks"]]

    def use(self, form: str) -> None:
        for layer, weight in zip(self.layers, self.weights[form]):
            layer.weight, layer.method = weight, QUANTIZED if form == "blocks" else UNQUANTIZED


def _matmuls_alone(weights: dict[str, list], batch: int, rounds: int, repeats: int = 3) -> dict[str, float]:
    """Median ms of [batch, in] x w^T over every weight of each form, the forms interleaved."""
    inputs = [torch.randn(batch, w.shape[1]) for w in weights["blocks"]]
    times: dict[str, list[float]] = {name: [] for name in weights}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, ws in weights.items():
                start = time.perf_counter()
                for _ in range(repeats):
                    for x, w in zip(inputs, ws):
                        mixed_linear(x, w)
                times[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _nbytes(w) -> int:
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.shape.numel() * 4  # a oneDNN-packed tensor reports no storage of its own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("head", "q5_0"), default="head")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="decode steps per form per round")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()

    core = EngineCore(EngineConfig.from_kwargs(model="gemma3-270m", dtype="float32", device="cpu",
                                               log_stats_interval=0, kv_cache_memory=0.5), progress=False)
    model = core.executor.worker.runner.model
    forms = HeadForms(model) if args.what == "head" else LayerForms(model, ("qkv_proj", "gate_up_proj"))
    if not all(isinstance(w, QuantizedWeight) for w in forms.weights["blocks"]):
        raise SystemExit("these weights are not quantized here (native kernels off?): nothing to compare")
    rss_blocks = rss_mib()
    forms.build_float32()
    rss_dense = rss_mib()

    total = args.context + (args.steps + 1) * args.rounds * 2 + 4
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(100, 200_000, (args.context,), generator=g).tolist()
        core.add_request(EngineCoreRequest(request_id=f"b{i}", prompt_token_ids=prompt, sampling_params=params,
                                           arrival_time=time.time(), priority=0, eos_token_ids=[1]))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()) \
            or core.scheduler.waiting:
        core.step()
    times: dict[str, list[float]] = {"blocks": [], "float32": []}
    for _ in range(args.rounds):
        for form in times:
            forms.use(form)
            core.step()  # one untimed step after the switch
            for _ in range(args.steps):
                start = time.perf_counter()
                core.step()
                times[form].append(time.perf_counter() - start)
    forms.use("blocks")
    core.shutdown()
    alone = _matmuls_alone(forms.weights, args.batch, args.rounds)

    step = {form: statistics.median(t) * 1e3 for form, t in times.items()}
    print(f"{args.what}: batch {args.batch}, context {args.context}, {args.rounds} rounds x {args.steps} steps a form")
    for form in times:
        mib = sum(_nbytes(w) for w in forms.weights[form]) / 2 ** 20
        print(f"  {form:>8}: decode step {step[form]:7.1f} ms, its matmuls alone {alone[form]:7.1f} ms, "
              f"{mib:6.0f} MiB")
    print(f"  float32 / blocks: step {step['float32'] / step['blocks']:.2f}x, "
          f"matmuls {alone['float32'] / alone['blocks']:.2f}x")
    print(f"  RSS: {rss_blocks:.0f} MiB with the blocks, {rss_dense:.0f} MiB once the float32 copies exist")


if __name__ == "__main__":
    main()
