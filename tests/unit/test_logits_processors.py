"""`--logits-processors` (vLLM v1's batch-level processors) and FastDeploy's early stop, on a tiny random Llama
through the EngineCore: a processor sees each row's own arguments, changes only the rows that ask, and one that
raises ends only the request that made it raise."""
from __future__ import annotations

import helpers
import pytest
import torch

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.errors import RequestValidationError
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.input_processor import InputProcessor
from tokenloom.model.early_stop import RepetitionEarlyStop
from tokenloom.model.logits_processor import load_processor_class
from tokenloom.model.model_path import resolve_model_path
from tokenloom.model.sampling_row import SamplingRow
from tokenloom.tokenizer import Tokenizer

PROMPT = [5, 17, 99, 23, 41, 7]
EOS = 2  # the tiny models' generation_config.json


def _run(core, requests: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str | None]]:
    for rid, params in requests.items():
        core.add_request(helpers.make_request(rid, PROMPT, params))
    out = {rid: ([], None) for rid in requests}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    return out


def _greedy(**extra_args) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra_args or None)


@pytest.fixture(scope="module")
def core(make_core):
    return make_core("llama", logits_processors=["logits_processor_examples:BanToken",
                                                  "logits_processor_examples.RaiseWhenAsked"])


def test_a_processor_changes_only_the_rows_whose_arguments_ask(core):
    base = _run(core, {"alone": _greedy()})["alone"][0]
    both = _run(core, {"base": _greedy(), "banned": _greedy(ban=base[0])})
    assert both["base"][0] == base
    assert both["banned"][0][0] != base[0]


def test_a_processor_that_raises_ends_only_the_request_that_made_it_raise(core):
    base = _run(core, {"alone": _greedy()})["alone"][0]
    both = _run(core, {"other": _greedy(), "culprit": _greedy(**{"raise": True})})
    assert both["culprit"][1] == "error"
    assert both["other"] == (base, "length")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


def test_bad_request_arguments_are_refused_before_the_engine(tokenizer):
    config = EngineConfig.from_kwargs(logits_processors=["logits_processor_examples:BanToken"])
    processor = InputProcessor(tokenizer, config, 512, 49152, [])
    with pytest.raises(RequestValidationError, match="BanToken: ban must be a token id") as err:
        processor.validate([1, 2], SamplingParams(extra_args={"ban": "x"}))
    assert err.value.param == "vllm_xargs"


@pytest.mark.parametrize("name, reason", [("no_such_module:Thing", "cannot import"),
                                          ("os.path:join", "is not a subclass of tokenloom.LogitsProcessor"),
                                          ("JustAName", "expected module:Class")])
def test_a_processor_name_that_does_not_load_is_a_one_line_config_error(name, reason):
    with pytest.raises(ConfigError, match=reason):
        load_processor_class(name)


def test_early_stop_ends_a_sequence_whose_top_token_stayed_certain(make_core):
    """A threshold every tiny-model step passes: the window's last position is forced to end of sequence."""
    config = '{"enable_early_stop": true, "window_size": 3, "threshold": 0.0001}'
    plain = _run(make_core("llama"), {"r": _greedy()})["r"][0]
    tokens, finish = _run(make_core("llama", early_stop_config=config), {"r": _greedy()})["r"]
    assert tokens == plain[:2] + [EOS] and finish == "stop"


def _row(request_id: str, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1], [], eos_token_ids=[EOS], request_id=request_id)


def test_early_stop_counts_each_request_on_its_own_and_spares_ignore_eos():
    stop = RepetitionEarlyStop(EngineConfig.from_kwargs(early_stop_config={"enable_early_stop": True,
                                                                          "window_size": 2, "threshold": 0.9}), "cpu")
    confident = torch.tensor([10.0, 0.0, 0.0, 0.0])
    unsure = torch.zeros(4)
    rows = [_row("a"), _row("b"), _row("c", ignore_eos=True)]
    first = stop.apply(torch.stack([confident, unsure, confident]), rows)
    assert torch.equal(first[0], confident)
    second = stop.apply(torch.stack([confident, confident, confident]), rows)
    assert second[0].argmax() == EOS and torch.isinf(second[0]).sum() == 3
    assert torch.equal(second[1], confident) and torch.equal(second[2], confident)
