"""`--logprobs-mode` (vLLM's names): what a request's logprobs report, checked on a tiny random Llama against
values computed from transformers' logits on the same weights (teacher-forced over the generated tokens)."""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.input_processor import InputProcessor
from tokenloom.model.model_path import resolve_model_path
from tokenloom.tokenizer import Tokenizer

TOL = 5e-5  # float32 on both sides: the tiny reference tests' logit tolerance
PROMPT = [5, 17, 99, 23, 41, 7]


def _generate(make_core, params: SamplingParams) -> tuple[list[int], list[float]]:
    """The generated tokens and each one's reported value."""
    core = make_core("llama")
    core.add_request(helpers.make_request("r", PROMPT, params))
    tokens, values = [], []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            values += [position[0][1] for position in out.new_logprobs or []]
    return tokens, values


def _hf_logits(tiny_models, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at each generated token's position: [len(tokens), V]."""
    _, hf = tiny_models("llama")
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].float()
    return logits[len(PROMPT) - 1:len(PROMPT) - 1 + len(tokens)]


def test_raw_logits_are_the_models_logits(make_core, tiny_models):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, logprobs_mode="raw_logits")
    tokens, values = _generate(make_core, params)
    want = _hf_logits(tiny_models, tokens)
    assert len(values) == len(tokens) == 6
    for i, (token, value) in enumerate(zip(tokens, values)):
        assert abs(value - want[i, token].item()) < TOL


def test_processed_logprobs_are_the_distribution_the_token_was_drawn_from(make_core, tiny_models):
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=6, logprobs=0,
                            logprobs_mode="processed_logprobs")
    tokens, values = _generate(make_core, params)
    logits = _hf_logits(tiny_models, tokens)
    for i, (token, value) in enumerate(zip(tokens, values)):
        kept = logits[i].topk(5).indices
        masked = torch.full_like(logits[i], float("-inf"))
        masked[kept] = logits[i][kept] / 0.7
        assert token in kept.tolist()
        assert abs(value - torch.log_softmax(masked, -1)[token].item()) < TOL


def test_raw_logprobs_ignore_temperature_and_top_k(make_core, tiny_models):
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=6, logprobs=0)
    tokens, values = _generate(make_core, params)
    logprobs = torch.log_softmax(_hf_logits(tiny_models, tokens), -1)
    for i, (token, value) in enumerate(zip(tokens, values)):
        assert abs(value - logprobs[i, token].item()) < TOL


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


def _processor(tokenizer, mode: str) -> InputProcessor:
    return InputProcessor(tokenizer, EngineConfig.from_kwargs(logprobs_mode=mode), 512, 49152, [])


def test_the_engine_mode_applies_to_requests_that_do_not_choose(tokenizer):
    params = _processor(tokenizer, "processed_logits").validate([1, 2, 3], SamplingParams(logprobs=1))
    assert params.logprobs_mode == "processed_logits"


def test_a_request_that_chooses_keeps_its_mode(tokenizer):
    params = _processor(tokenizer, "processed_logits").validate(
        [1, 2, 3], SamplingParams(logprobs=1, logprobs_mode="raw"))
    assert params.logprobs_mode == "raw_logprobs"


def test_an_unknown_engine_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="logprobs_mode must be one of raw_logprobs"):
        EngineConfig.from_kwargs(logprobs_mode="logits")
