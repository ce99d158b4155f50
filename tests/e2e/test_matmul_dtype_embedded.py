"""The embedded model in the fast CPU mode (--matmul-dtype bfloat16 --kv-cache-dtype bfloat16) against
transformers in float32.

Tolerance policy: bfloat16 rounds every weight, every matmul input and every cached key and value to 8
significant bits, so logits move
by a few percent and greedy decoding may take a different branch where transformers' top two tokens are
close. The check is the usual one for reduced-precision engines: both greedy continuations agree until the
first divergence, and there each side's token is among the other side's top 5 and the two were a near tie
in transformers' distribution (within NEAR_TIE nats). Where they agree, the logprob of the chosen token stays
within LOGPROB_TOL of transformers' (measured: at most ~0.1). The outputs must also agree for most of their
length (MIN_AGREEING of all steps): a model that diverged at the first token everywhere would otherwise
check nothing.
"""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom import LLM
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.layers.linear import Linear

NEW_TOKENS = 24
TOP_K = 5
LOGPROB_TOL = 0.3
# A divergence is only acceptable where transformers' top tokens were this close (bfloat16 moves logits
# by a few percent: measured gaps at divergences here are below 0.2 nats).
NEAR_TIE = 0.5
MIN_AGREEING = 0.5
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def llm(embedded_path):
    return LLM(embedded_path, progress=False, dtype="float32", matmul_dtype="bfloat16", kv_cache_dtype="bfloat16",
               device="cpu", num_blocks=128, log_stats_interval=0)


def test_linear_weights_and_kv_cache_are_bfloat16_and_activations_float32(llm):
    model = llm.engine.executor.worker.setup.loaded.model
    assert all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, Linear))
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert llm.engine.executor.worker.runner.kv_caches[0].dtype == torch.bfloat16
    assert llm.engine.executor.worker.setup.dtype == torch.float32


def test_greedy_output_agrees_with_transformers_up_to_a_near_tie(llm, hf_embedded):
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                   logprobs=TOP_K), use_tqdm=False)
    reference = helpers.hf_greedy_batch(hf_embedded, prompts, NEW_TOKENS)
    worst, identical, agreeing, compared = 0.0, 0, 0, 0
    for prompt, out, want in zip(prompts, outputs, reference):
        got, entries = out.outputs[0].token_ids, out.outputs[0].logprobs
        ref = helpers.hf_log_softmax(hf_embedded, prompt + want)
        compared += len(want)
        for step, (mine, theirs) in enumerate(zip(got, want)):
            row = ref[len(prompt) - 1 + step]
            if mine != theirs:
                assert mine in row.topk(TOP_K).indices.tolist(), f"step {step}: our token not in their top {TOP_K}"
                assert theirs in entries[step], f"step {step}: their token not in our top {TOP_K}"
                gap = row[theirs].item() - row[mine].item()
                assert gap < NEAR_TIE, f"step {step}: diverged where transformers preferred its token by {gap:.2f}"
                break
            agreeing += 1
            worst = max(worst, abs(entries[step][mine].logprob - row[mine].item()))
        else:
            identical += 1
    print(f"bfloat16 matmuls and KV cache: {identical}/{len(prompts)} greedy outputs identical, {agreeing}/"
          f"{compared} steps agree; max abs logprob diff before divergence {worst:.3f}")
    assert agreeing >= MIN_AGREEING * compared, f"only {agreeing} of {compared} steps agree"
    assert worst < LOGPROB_TOL
