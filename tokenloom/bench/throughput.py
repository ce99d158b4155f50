"""Offline throughput: N random prompts of fixed lengths through LLM.generate (and optionally transformers)."""
from __future__ import annotations

import json
import time

import torch

from tokenloom.bench.decode_profile import profile_decode
from tokenloom.bench.hf_baseline import run_transformers
from tokenloom.config import EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.entrypoints.llm import LLM
from tokenloom.profiler import PROFILER


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def run_throughput(ns) -> int:

    config = EngineConfig.from_args(ns)
    flat = {**vars(config.model), **vars(config.cache), **vars(config.scheduler), **vars(config.parallel)}
    llm = LLM(**flat)
    prompts = _random_prompts(ns.num_prompts, ns.input_len, llm.engine.info.vocab_size, ns.bench_seed)
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    PROFILER.reset()
    PROFILER.enabled = ns.profile
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    PROFILER.enabled = False
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {
        "num_prompts": ns.num_prompts, "input_len": ns.input_len, "output_len": ns.output_len,
        "elapsed_s": elapsed, "requests_per_s": ns.num_prompts / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + ns.num_prompts * ns.input_len) / elapsed,
        "num_preemptions": llm.engine.stats()["num_preemptions"],
    }
    print(f"tokenloom: {results['requests_per_s']:.2f} requests/s, "
          f"{results['output_tokens_per_s']:.1f} output tokens/s, "
          f"{results['total_tokens_per_s']:.1f} total tokens/s ({elapsed:.1f} s)")
    if ns.profile:
        print(f"step profile over {PROFILER.steps} steps:\n{PROFILER.format()}")
        results["step_profile"] = PROFILER.report()
    if ns.decode_profile:
        results["decode_profile"] = profile_decode(llm, ns.decode_profile, ns.input_len)
        d = results["decode_profile"]
        if "matmul_ms" in d:
            print(f"decode step at batch {d['batch']}: {d['step_ms']:.1f} ms; model matmuls alone "
                  f"{d['matmul_ms']:.1f} ms (ratio {d['ratio']:.2f})")
        else:
            print(f"decode step at batch {d['batch']}: {d['step_ms']:.1f} ms")
    if ns.compare_transformers:
        import torch

        hf = run_transformers(llm.engine.info.model_path, prompts, ns.output_len, ns.transformers_batch,
                              getattr(torch, ns.transformers_dtype))
        results["transformers"] = hf
        results["speedup_vs_transformers"] = results["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(f"transformers: {hf['output_tokens_per_s']:.1f} output tokens/s "
              f"(batch {ns.transformers_batch}, {hf['dtype']}); "
              f"tokenloom is {results['speedup_vs_transformers']:.2f}x")
    llm.shutdown()
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
