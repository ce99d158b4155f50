"""`tokenloom bench throughput|serve|decode|roofline|moe|eplb|collectives|vision|vlm` argument wiring."""
from __future__ import annotations

import argparse

from tokenloom.bench.collectives import add_collectives_args
from tokenloom.bench.decode_step import add_decode_args
from tokenloom.bench.eplb import add_eplb_args
from tokenloom.bench.moe_layer import add_moe_args
from tokenloom.bench.roofline import add_roofline_args
from tokenloom.bench.vision_tower import add_vision_args
from tokenloom.bench.vlm_serving import add_vlm_args
from tokenloom.config import add_engine_args

try:
    from tokenloom.bench.serve import add_serve_bench_args
except ImportError:  # httpx missing: the serve bench is left out
    add_serve_bench_args = None


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("throughput", help="offline: random prompts through LLM.generate")
    p.add_argument("-m", "--model", dest="model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-seed", dest="bench_seed", type=int, default=0)
    p.add_argument("--compare-transformers", action="store_true",
                   help="also run HF transformers (batched, padded, greedy) on the same prompts and report the ratio")
    p.add_argument("--transformers-batch", type=int, default=32)
    p.add_argument("--transformers-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype transformers runs in (its weights and activations)")
    p.add_argument("--decode-profile", type=int, default=32, metavar="BATCH",
                   help="time a decode step at this batch size against the model's matmuls alone (0 = skip)")
    p.add_argument("--profile", action="store_true",
                   help="print where the engine's step time goes (schedule, inputs, attention, matmuls, sampling...)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    add_engine_args(p, model_positional=False)

    def run(ns):
        from tokenloom.bench.throughput import run_throughput  # lazy: the offline LLM loads only for this bench
        return run_throughput(ns)
    p.set_defaults(func=run)

    add_decode_args(sub.add_parser("decode", help="time of one decode step at given batch sizes (any model, any "
                                                  "--tensor-parallel-size; no tokenizer needed)"))

    add_roofline_args(sub.add_parser("roofline", help="a batch-1 decode step's bytes and time against the machine's "
                                                     "memory bandwidth (STREAM-style triad, same threads)"))

    add_moe_args(sub.add_parser("moe", help="one mixture-of-experts layer: grouped experts against per-expert and "
                                            "per-token loops and a dense MLP of the same active size"))

    add_eplb_args(sub.add_parser("eplb", help="expert parallel load balancing: the ranks' share of a skewed "
                                            "MoE workload before and after the experts are re-placed"))

    add_collectives_args(sub.add_parser("collectives", help="all-reduce latency across processes, and its "
                                                           "alpha-beta fit for the tensor-parallel cost model"))

    add_vision_args(sub.add_parser("vision", help="images/s through the Qwen2.5-VL vision tower (3B shapes, random "
                                                 "weights) against transformers' on the same weights"))

    add_vlm_args(sub.add_parser("vlm", help="TTFT for one image + ~100 words with the encoder cache on and off "
                                           "(Qwen2.5-VL-3B tower shapes, tiny text model, random weights) against "
                                           "transformers on the same weights"))

    if add_serve_bench_args is not None:
        add_serve_bench_args(sub.add_parser("serve", help="load test of an OpenAI-compatible server"))
