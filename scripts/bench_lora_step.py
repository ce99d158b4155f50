"""What an adapter adds to one decode step of the native decoder stack, the rest of the engine left out.

Runs the embedded model (or --model) with one adapter request until a batch-1 decode step, keeps that step's
`tokenloom::decoder_stack` arguments, then times the op on them with the adapter row and with no LoRA at all,
taking turns (so a load spike from other jobs hits both alike): milliseconds a step, best of --rounds rounds of
50 calls. The served figures in docs/lora.md add the scheduler, sampling and the API process to both sides.

Usage: .venv/bin/python scripts/make_random_lora.py /tmp/lora --dtype bfloat16
       .venv/bin/python scripts/bench_lora_step.py /tmp/lora/a0 [--rank 16] [--lora-dtype bfloat16] [--rounds 20]
"""
import argparse
import time

import torch

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.model.native_stack import NativeStack

parser = argparse.ArgumentParser()
parser.add_argument("adapter", help="a PEFT adapter folder (scripts/make_random_lora.py makes some)")
parser.add_argument("--model", default="smollm2-135m-instruct")
parser.add_argument("--rank", type=int, default=16, help="the slots' rank (--max-lora-rank)")
parser.add_argument("--lora-dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
parser.add_argument("--rounds", type=int, default=20)
args = parser.parse_args()

llm = LLM(args.model, enable_lora=True, max_loras=1, max_lora_rank=args.rank, lora_dtype=args.lora_dtype)
steps: list[tuple] = []
run = NativeStack.run


def keep_adapter_steps(stack: NativeStack, *step_args, **kwargs) -> torch.Tensor:
    op_args = stack.op_args(*step_args, **kwargs)
    if op_args[-1] is not None:
        steps.append(op_args)
    return torch.ops.tokenloom.decoder_stack(*op_args)


NativeStack.run = keep_adapter_steps
llm.generate(["Tell me a story"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False,
             lora_request=LoRARequest("adapter", 1, args.adapter))
NativeStack.run = run
with_adapter = list(steps[-1])
if with_adapter[0].shape[0] != 1:
    raise SystemExit("the last adapter step was not a batch-1 decode")
no_lora = with_adapter[:-5] + [[], [], [], None, None]


def ms_a_step(op_args: list, calls: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        torch.ops.tokenloom.decoder_stack(*op_args)
    return (time.perf_counter() - start) / calls * 1e3


best = {"base": float("inf"), "adapter": float("inf")}
for _ in range(args.rounds):
    best["base"] = min(best["base"], ms_a_step(no_lora))
    best["adapter"] = min(best["adapter"], ms_a_step(with_adapter))
print(f"decode step, batch 1, rank {args.rank} {args.lora_dtype} slots: base {best['base']:.3f} ms, "
      f"with the adapter {best['adapter']:.3f} ms (+{best['adapter'] - best['base']:.3f} ms, "
      f"{best['adapter'] / best['base']:.3f}x)")
