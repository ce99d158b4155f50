"""The embedded model (9 heads, 3 KV heads) split over three worker processes, against one.

TP=3 sums each layer's output in three partial products, so logits differ from TP=1 by float rounding:
greedy text may flip only where the two best tokens are nearly tied, and the test checks that every flip
is at such a near-tie.
"""
from __future__ import annotations

import pytest

from tokenloom import LLM
from tokenloom.config import ConfigError
from tokenloom.core.sampling_params import SamplingParams

pytestmark = pytest.mark.tp

NEW_TOKENS = 24
# Largest top-1/top-2 logprob gap at which a flip is excused. TP=3 logprobs differ from TP=1 by ~1e-5
# (measured on these prompts); ten times more still marks a real near-tie.
NEAR_TIE = 1e-3
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
ENGINE = dict(dtype="float32", device="cpu", num_blocks=128, max_num_seqs=8, log_stats_interval=0)
# Two logprobs per step: the gap between the two best tokens is what excuses a flip.
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tp1(make_llm):
    return make_llm(num_blocks=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(tp1):
    return [tp1.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def test_tp3_greedy_output_equals_tp1_except_at_near_ties(tp1, prompts):
    want = tp1.generate(prompts, PARAMS, use_tqdm=False)
    with LLM(progress=False, tensor_parallel_size=3, **ENGINE) as tp3:
        got = tp3.generate(prompts, PARAMS, use_tqdm=False)
    flips = 0
    for w, g in zip(want, got):
        ref, ours = w.outputs[0], g.outputs[0]
        assert all(len(position) == 2 for position in ref.logprobs)  # what a flip would be judged by
        diverged = next((i for i, (a, b) in enumerate(zip(ref.token_ids, ours.token_ids)) if a != b), None)
        if diverged is None:
            assert ref.token_ids == ours.token_ids
            continue
        flips += 1
        top = sorted((lp.logprob for lp in ref.logprobs[diverged].values()), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, f"flip at token {diverged} with a clear winner ({top[0] - top[1]:.2e})"
    assert flips <= 1  # near-ties are rare: more flips would mean a real difference


def test_tp2_on_the_embedded_model_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        LLM(progress=False, tensor_parallel_size=2, **ENGINE)
    assert str(e.value) == "tensor_parallel_size 2 does not divide its 9 attention heads or its 3 KV heads " \
                           "(nor is it a multiple of them)"
