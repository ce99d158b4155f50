"""The 8-bit KV cache (and, for scale, the bfloat16 one) against the float32 one on the embedded model
(docs/performance.md, "The 8-bit KV cache"): prompt logprobs of real text (each position's token given the
cached prefix), teacher-forced top-1 agreement, and greedy continuations compared token by token.

Usage: .venv/bin/python scripts/kv_int8_accuracy.py [--new-tokens 64]
"""
import argparse

from tokenloom import LLM
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.model_path import embedded_model_path

TEXTS = [
    "The river rises in the hills to the north and flows south through farmland for about two hundred "
    "kilometres before it reaches the sea near the old harbour town. In spring the snow melts and the water "
    "runs high and brown; by late summer it is slow and clear, and children swim in the pools below the mill.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let it rise until it "
    "has doubled in size, then shape it and bake it in a hot oven. A longer, cooler rise gives more flavour, "
    "and a tray of water in the oven gives the crust its shine.",
    "def mean(values):\n    if not values:\n        raise ValueError('no values')\n"
    "    return sum(values) / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "The committee met on Tuesday and agreed to postpone the vote until the budget figures had been checked "
    "by an independent auditor. Several members said that the delay was regrettable but necessary, and the "
    "chair promised a full report before the end of the month.",
    "<|im_start|>user\nExplain in a few sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
]


def run(llm: LLM, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, prompt_logprobs=1)
    return llm.generate(prompts, params, use_tqdm=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    ns = parser.parse_args()
    path = embedded_model_path()
    results = {}
    for dtype in ("float32", "bfloat16", "int8"):
        llm = LLM(path, progress=False, dtype="float32", kv_cache_dtype=dtype, device="cpu", num_blocks=256,
                  log_stats_interval=0)
        prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
        results[dtype] = run(llm, prompts, ns.new_tokens)
        del llm
    for dtype in ("bfloat16", "int8"):
        compare(dtype, prompts, results["float32"], results[dtype], ns.new_tokens)


def compare(dtype: str, prompts: list[list[int]], reference, outputs, new_tokens: int) -> None:
    diffs, top1, positions, same_prefix, identical = [], 0, 0, 0, 0
    for prompt, full, other in zip(prompts, reference, outputs):
        for pos in range(1, len(prompt)):
            a, b = full.prompt_logprobs[pos], other.prompt_logprobs[pos]
            diffs.append(abs(a[prompt[pos]].logprob - b[prompt[pos]].logprob))
            top1 += int(min(a, key=lambda t: a[t].rank) == min(b, key=lambda t: b[t].rank))
            positions += 1
        x, y = full.outputs[0].token_ids, other.outputs[0].token_ids
        agree = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same_prefix += agree
        identical += int(agree == len(x))
    print(f"{dtype} KV cache vs float32 over {positions} prompt positions of {len(TEXTS)} texts: prompt logprob "
          f"|diff| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f} nats, top-1 agreement {top1}/{positions}; "
          f"greedy {identical}/{len(TEXTS)} continuations identical over {new_tokens} tokens, "
          f"{same_prefix}/{len(TEXTS) * new_tokens} tokens before the first divergence")

if __name__ == "__main__":
    main()
