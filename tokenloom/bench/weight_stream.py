"""`python -m tokenloom.bench.weight_stream`: one pass over every quantized weight of a model, as a decode
step makes it, in the ways the weights can be held, taking turns so machine noise hits them alike.

At one row a decode step is bound by reading the weights (96 MiB on the embedded model, more than the
L3 cache, so every pass reads them from memory). The variants:
- `fp32 scales, 4 KiB pages`: the interleaved form before float16 scales and huge pages (a K-quant's
  integer scales and super-block factors stay as they are);
- `fp16 scales, 4 KiB pages`: float16 block scales and mins (tokenloom/kernels/quant.py compact_scales);
- `fp16 scales, huge pages`: as the engine loads them (tokenloom/model/huge_pages.py).
The figures of docs/performance.md's "The batch-1 step" come from here. Use `--threads 1` on a loaded
machine: it times on the thread's own CPU clock, so time spent descheduled does not count.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from tokenloom import kernels
from tokenloom.model.layers.quantized_linear import quantized_weights
from tokenloom.model.layers.quantized_weight import Panels, QuantizedWeight
from tokenloom.model.loader import load_model


def _on_plain_pages(w: QuantizedWeight, scale_dtype: torch.dtype) -> QuantizedWeight:
    p = w.panels
    if p.scales.dtype == torch.int8:  # a K-quant's integer scales and float32 factors: kept as they are
        return replace(w, panels=Panels(p.qpacked.clone(), p.scales.clone(), p.mins.clone(), p.columns))
    return replace(w, panels=Panels(p.qpacked.clone(), p.scales.to(scale_dtype).clone(),
                                    p.mins.to(scale_dtype).clone(), p.columns))


def _variants(weights: list[QuantizedWeight]) -> dict[str, list[QuantizedWeight]]:
    return {
        "fp32 scales, 4 KiB pages": [_on_plain_pages(w, torch.float32) for w in weights],
        "fp16 scales, 4 KiB pages": [_on_plain_pages(w, w.panels.scales.dtype) for w in weights],
        "fp16 scales, huge pages": weights,
    }


def _mib(weights: list[QuantizedWeight]) -> float:
    return sum(w.nbytes for w in weights) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    p.add_argument("--rows", type=int, default=1, help="rows a matmul (1: a batch-1 decode step)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=25, help="passes a variant, taking turns")
    p.add_argument("--quantized-matmul", default="exact", choices=("exact", "w4a8"))
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if not kernels.load():
        raise SystemExit("the native kernels are not loaded: nothing to measure")
    loaded = load_model(ns.model, torch.float32, torch.device("cpu"), progress=False, quantized=True)
    weights = list({id(w): w for w in quantized_weights(loaded.model)}.values())
    for w in weights:
        w.activations_int8 = ns.quantized_matmul == "w4a8"
    variants = _variants(weights)
    inputs = {k: torch.randn(ns.rows, k) for k in {w.shape[1] for w in weights}}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ns.rounds + 1):  # the first round warms up
        for name, ws in variants.items():
            start = clock()
            for w in ws:
                w.linear(inputs[w.shape[1]])
            times[name].append(clock() - start)
    base = None
    print(f"{len(weights)} weights, {ns.rows} row(s), {torch.get_num_threads()} thread(s), {ns.quantized_matmul}; "
          f"ms a pass, best and median of {ns.rounds}")
    for name, ts in times.items():
        ts = sorted(ts[1:])
        best, median = ts[0] * 1e3, ts[len(ts) // 2] * 1e3
        base = base or median
        print(f"  {name:26s} {_mib(variants[name]):6.1f} MiB  best {best:7.2f}  median {median:7.2f}  "
              f"({median / base:.2f}x the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
