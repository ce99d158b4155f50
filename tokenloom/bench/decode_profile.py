"""How a decode step compares with the model's matmuls alone at the same batch size."""
from __future__ import annotations

import time

import torch

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.layers.linear import Linear, mixed_linear


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def matmul_seconds(model: torch.nn.Module, batch: int, repeats: int = 5) -> float:
    """Every linear layer plus the LM head, on [batch, in] inputs."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m: torch.randn(batch, m.weight.shape[1], dtype=m.weight.dtype) for m in linears}
    head = model.head_weight()
    x_head = torch.randn(batch, head.shape[1], dtype=head.dtype)

    def run():
        for m in linears:
            mixed_linear(inputs[m], m.weight, m.bias)
        mixed_linear(x_head, head)
    return _time(run, repeats)


def profile_decode(llm, batch: int, context: int, steps: int = 8) -> dict:
    """Fill the engine with `batch` requests, then time pure decode steps."""
    engine = llm.engine
    prompts = torch.randint(100, 1000, (batch, context)).tolist()
    llm._add(prompts, SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True), None)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) \
            or engine.scheduler.waiting:
        llm.output_processor.process_outputs(engine.step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.output_processor.process_outputs(engine.step())
        times.append(time.perf_counter() - start)
    for _ in llm._run():
        pass
    step = sorted(times)[len(times) // 2]
    worker = getattr(engine.executor, "worker", None)  # the model is in this process (uni executor) only
    if worker is None:
        return {"batch": batch, "step_ms": step * 1e3}
    mm = matmul_seconds(worker.runner.model, batch)
    return {"batch": batch, "step_ms": step * 1e3, "matmul_ms": mm * 1e3, "ratio": step / mm}
