"""Gemma 3 under tensor parallelism: TP=2 against TP=1, on a tiny random Gemma 3 and on the real 270M GGUF.

Both have one KV head for four query heads, so at TP=2 each rank holds two query heads and a replica of the
KV head. The tiny model has windowed and global layers (window 8, different rotary bases), a query scale
that is not head_dim**-0.5 and final-logit soft-capping; the real one its 512-token windows, its quantized
layers (with the native kernels: Q5_0/Q8_0 q/k/v and gate/up split by rows, Q4_K/Q6_K o_proj and down_proj
by whole blocks of columns) and the 262,144-row Q8_0 tied embedding split by rows, the lookup scaled by
sqrt(hidden) after the all-reduce.

Tolerance: the two ranks' partial sums are added in another order than one process adds them (float32), so
prompt logprobs agree within 1e-4 (as tests/unit/test_tensor_parallel.py) and greedy tokens are identical.
"""
from __future__ import annotations

import helpers
import pytest
import torch
import transformers
from helpers import greedy_params, make_request

from tokenloom.config import EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.tokenizer import Tokenizer

pytestmark = pytest.mark.tp

WINDOW = 8
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_gemma_one_kv_head(tmp_path_factory) -> str:
    """3 layers (windowed, global, windowed), 4 query heads sharing 1 KV head, random (1 + w) norms."""
    config = transformers.Gemma3TextConfig(
        **{**helpers.TINY_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 16},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=WINDOW,
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return helpers.save_tiny_model(hf, str(tmp_path_factory.mktemp("tiny_gemma3_kv1")))


def _core(model: str, **kwargs) -> EngineCore:
    args = dict(model=model, dtype="float32", device="cpu", log_stats_interval=0)
    return EngineCore(EngineConfig.from_kwargs(**{**args, **kwargs}), progress=False)


def _prompt_logprobs(core: EngineCore, prompt: list[int]) -> list[float]:
    core.add_request(make_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)))
    first = None
    while core.has_unfinished_requests():
        for out in core.step():
            first = first or out.prompt_logprobs
    return [entry[0][1] for entry in first[1:]]


def _assert_tp2_matches_tp1(one: EngineCore, two: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    for prompt in prompts:
        a, b = _prompt_logprobs(one, prompt), _prompt_logprobs(two, prompt)
        assert len(a) == len(b) == len(prompt) - 1
        assert max(abs(x - y) for x, y in zip(a, b)) < LOGPROB_TOLERANCE
    params = greedy_params(max_tokens)
    assert helpers.generate_tokens(two, prompts, params) == helpers.generate_tokens(one, prompts, params)


def test_tiny_gemma3_with_one_kv_head_at_tp2_matches_tp1_past_its_window(tiny_gemma_one_kv_head):
    """Prompts of 5 to 47 tokens and 24 generated ones: every windowed layer reads past its 8-token window,
    prefilled in 7-token chunks over 4-token blocks."""
    prompts = helpers.random_prompts(3, [5, 30, 47], 512, seed=4)
    args = dict(num_blocks=96, block_size=4, max_num_batched_tokens=7, long_prefill_token_threshold=5)
    one = _core(tiny_gemma_one_kv_head, **args)
    two = _core(tiny_gemma_one_kv_head, tensor_parallel_size=2, **args)
    try:
        _assert_tp2_matches_tp1(one, two, prompts, 24)
    finally:
        two.shutdown()
        one.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gemma3_270m_at_tp2_matches_tp1_past_the_512_token_window():
    """Slow: two loads of the 262,144-token model per engine and prompts of over 600 tokens on 2 cores.
    A counting prompt long enough that the local layers see only its end, and a short prose one, prefilled in
    256-token chunks."""
    from tokenloom.model.model_path import resolve_model_path
    tokenizer = Tokenizer.from_gguf(resolve_model_path("gemma3-270m"))
    texts = [", ".join(str(i) for i in range(1, 260)) + ",", "The capital of France is"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len(prompts[0]) > 600
    args = dict(num_blocks=160, max_num_batched_tokens=256)
    one = _core("gemma3-270m", **args)
    two = _core("gemma3-270m", tensor_parallel_size=2, **args)
    try:
        _assert_tp2_matches_tp1(one, two, prompts, 12)
    finally:
        two.shutdown()
        one.shutdown()
