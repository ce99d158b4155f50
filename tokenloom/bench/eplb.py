"""`tokenloom bench eplb`: how evenly the expert-parallel ranks share a mixture-of-experts model's work, before
and after the load balancer re-places the experts (`--enable-eplb`), on a skewed workload.

The prompts are drawn from a few token ids (`--hot-tokens`), so the router sends most (token, expert) pairs to
a few experts, as a narrow real workload does. The figure is the balancer's own count: max / mean of the pairs
each rank computed (1.0 = even, p = all on one of p ranks), averaged over the MoE layers. "before" is the first
window, run on the starting placement; "after" is every later window, each run on the placement the one
before it chose (window_size = step_interval, so a window never spans two placements), next to what that
placement planned for the window it was chosen from.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tokenloom.config import EngineConfig, add_engine_args
from tokenloom.core.contract import ExpertLoadReport
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore

DEFAULT_EPLB_CONFIG = '{"window_size": 8, "step_interval": 8}'


def add_eplb_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", dest="model", default=None, help="a mixture-of-experts model")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts run at once (default 16)")
    p.add_argument("--input-len", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--hot-tokens", type=int, default=2, help="distinct token ids the prompts are drawn from "
                                                             "(default 2: a skewed routing)")
    p.add_argument("--dataset-seed", dest="bench_seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    add_engine_args(p, model_positional=False)
    p.set_defaults(func=run_eplb)


def skewed_prompts(num: int, length: int, hot_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` ids drawn from `hot_tokens` ids picked at random from the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(vocab_size, generator=g)[:hot_tokens]
    return [hot[torch.randint(0, hot_tokens, (length,), generator=g)].tolist() for _ in range(num)]


def expert_load_reports(core: EngineCore, prompts: list[list[int]], output_len: int) -> list[ExpertLoadReport]:
    """Run `prompts` to completion; the balancer's report of each re-placement, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"eplb-{i}", prompt_token_ids=prompt, sampling_params=params,
                                           arrival_time=time.time()))
    reports, last = [], None
    while core.has_unfinished_requests():
        core.step()
        if core.expert_load is not last:
            last = core.expert_load
            reports.append(last)
    return reports


def run_eplb(ns) -> int:
    ns.enable_expert_parallel = True
    ns.enable_eplb = True
    ns.eplb_config = ns.eplb_config or DEFAULT_EPLB_CONFIG
    config = EngineConfig.from_args(ns)
    eplb = config.parallel.eplb
    core = EngineCore(config)
    try:
        prompts = skewed_prompts(ns.num_prompts, ns.input_len, ns.hot_tokens, core.info.vocab_size, ns.bench_seed)
        reports = expert_load_reports(core, prompts, ns.output_len)
    finally:
        core.shutdown()
    if len(reports) < 2:
        print(f"only {len(reports)} re-placement(s): raise --output-len or lower step_interval")
        return 1
    after = [r.imbalance for r in reports[1:]]
    results = {"tensor_parallel_size": config.parallel.tensor_parallel_size, "window_size": eplb.window_size,
               "step_interval": eplb.step_interval, "num_redundant_experts": eplb.num_redundant_experts,
               "rebalances": len(reports), "experts_moved": reports[-1].experts_moved,
               "imbalance_before": reports[0].imbalance, "imbalance_after": sum(after) / len(after),
               "planned_after": sum(r.planned_imbalance for r in reports[:-1]) / len(after)}
    print(f"load max/mean per rank over {config.parallel.tensor_parallel_size} ranks, {ns.num_prompts} prompts of "
          f"{ns.input_len} tokens from {ns.hot_tokens} ids, {ns.output_len} generated, "
          f"{eplb.num_redundant_experts} redundant experts: before {results['imbalance_before']:.3f} (first "
          f"{eplb.window_size} steps), after {results['imbalance_after']:.3f} (mean of {len(after)} later windows, "
          f"{results['planned_after']:.3f} planned; {results['rebalances']} re-placements, "
          f"{results['experts_moved']} expert copies moved)")
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
