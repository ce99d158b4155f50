"""Specification of SamplingParams: defaults, validation, limits, helpers, msgpack transport."""
from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.core.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    SamplingType,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.logit_bias is None and p.allowed_token_ids is None and p.seed is None
    assert p.logprobs is None and p.prompt_logprobs is None and p.logprobs_mode is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.structured_outputs is None


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_stop_none_becomes_empty_list():
    assert SamplingParams(stop=None).stop == []


def test_logit_bias_string_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"42": 3}).logit_bias == {42: 3.0}


def test_int_temperature_is_stored_as_float():
    p = SamplingParams(temperature=1)
    assert isinstance(p.temperature, float)


def test_msgpack_round_trip():
    p = SamplingParams(
        n=2, best_of=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        logit_bias={5: 1.5, 100: -100.0}, seed=1234, max_tokens=None, min_tokens=3,
        stop=["\n\n", "END"], stop_token_ids=[2], include_stop_str_in_output=True,
        ignore_eos=True, bad_words=["darn"], allowed_token_ids=[1, 2, 3], logprobs=5,
        prompt_logprobs=1, skip_special_tokens=False, spaces_between_special_tokens=False,
        structured_outputs={"json": {"type": "object"}}, logprobs_mode="processed",
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert decoded == p


def test_round_trip_inside_engine_core_request():
    from tokenloom.core.messages import EngineCoreRequest

    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2],
                            sampling_params=SamplingParams(seed=7, stop="x"), arrival_time=0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert decoded.sampling_params == req.sampling_params


def test_decoding_invalid_params_is_rejected():
    bad = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


@pytest.mark.parametrize("field,value", [
    ("n", 0),
    ("best_of", 1),  # with n=2 below
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("stop", [""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("bad_words", [None]),
    ("allowed_token_ids", []),
    ("logprobs", -1),
    ("prompt_logprobs", -1),
    ("ignore_eos", "yes"),
    ("logprobs_mode", "processed_probs"),
    ("structured_outputs", "json"),
    ("seed", 2**64),
    ("n", 1.5),
    ("top_k", True),
])
def test_invalid_value_raises_error_naming_the_field_and_value(field, value):
    kwargs = {field: value}
    if field == "best_of":
        kwargs["n"] = 2
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
    assert field in str(exc.value)
    # The offending value (for a dict: the offending entry's value) is quoted.
    shown = [repr(value)] + ([repr(v) for v in value.values()] if isinstance(value, dict) else [])
    assert any(s in str(exc.value) for s in shown), str(exc.value)


def test_error_message_states_allowed_range():
    with pytest.raises(SamplingParamsError, match=r"top_p must be a float in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0)


def test_sampling_params_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)


def test_min_tokens_unbounded_when_max_tokens_is_none():
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000


def test_top_k_minus_one_means_disabled():
    p = SamplingParams(top_k=-1)
    assert not p.top_k_enabled and p.sampling_type == SamplingType.RANDOM


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.8, top_k=1).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=1).sampling_type == SamplingType.RANDOM_SEED


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


# ---------------------------------------------------------------- validate_limits


def test_limits_accept_defaults():
    SamplingParams(logprobs=20, prompt_logprobs=20).validate_limits()


def test_limit_on_logprobs_defaults_to_20():
    with pytest.raises(SamplingParamsError, match="logprobs") as exc:
        SamplingParams(logprobs=21).validate_limits()
    assert "21" in str(exc.value) and "20" in str(exc.value)


def test_limit_on_prompt_logprobs():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(prompt_logprobs=6).validate_limits(max_logprobs=5)
    assert exc.value.field == "prompt_logprobs"


def test_limit_on_n_and_best_of():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(n=5).validate_limits(max_n=4)
    assert exc.value.field == "n"
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(n=2, best_of=5).validate_limits(max_n=4)
    assert exc.value.field == "best_of"


def test_limit_on_number_and_length_of_stop_sequences():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(stop=["a", "b", "c"]).validate_limits(max_stop=2)
    assert exc.value.field == "stop"
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(stop=["abcdef"]).validate_limits(max_stop_len=5)
    assert exc.value.field == "stop"


def test_limit_on_logit_bias_entries():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(logit_bias={1: 1, 2: 1, 3: 1}).validate_limits(max_logit_bias=2)
    assert exc.value.field == "logit_bias"


@pytest.mark.parametrize("field,kwargs", [
    ("logit_bias", {"logit_bias": {100: 1.0}}),
    ("allowed_token_ids", {"allowed_token_ids": [1, 100]}),
    ("stop_token_ids", {"stop_token_ids": [100]}),
])
def test_token_ids_must_be_below_vocab_size(field, kwargs):
    SamplingParams(**kwargs).validate_limits(vocab_size=101)
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs).validate_limits(vocab_size=100)
    assert exc.value.field == field and "100" in str(exc.value)


def test_none_limit_means_unlimited():
    SamplingParams(n=1000, logprobs=1000).validate_limits(max_n=None, max_logprobs=None)


# ---------------------------------------------------------------- property-based

_any_value = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
    st.lists(st.integers(-3, 3), max_size=3), st.lists(st.text(max_size=2), max_size=2),
    st.dictionaries(st.integers(-2, 5), st.floats(-200, 200), max_size=2),
)

_field_values = {
    "n": st.integers(-2, 5),
    "best_of": st.one_of(st.none(), st.integers(-2, 8)),
    "temperature": st.one_of(st.floats(-1, 5), st.sampled_from([math.nan, math.inf])),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.5, 1.5),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(-2, 50000),
                                                       st.floats(-150, 150), max_size=3)),
    "seed": st.one_of(st.none(), st.integers(-(2**65), 2**65)),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 64)),
    "min_tokens": st.integers(-1, 64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(-1, 100), max_size=3),
    "bad_words": st.lists(st.text(max_size=3), max_size=2),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(-1, 100), max_size=3)),
    "logprobs": st.one_of(st.none(), st.integers(-2, 30)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 30)),
    "ignore_eos": st.booleans(),
    "logprobs_mode": st.sampled_from(["raw", "processed", "raw_logits", "processed_logits", "bogus"]),
}


def _expected_valid(kw: dict) -> bool:
    """Independent statement of the validity rules."""
    def real(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    n = kw.get("n", 1)
    max_tokens = kw.get("max_tokens", 16)
    checks = [
        n >= 1,
        kw.get("best_of") is None or kw["best_of"] >= n,
        real(kw.get("temperature", 1.0)) and kw.get("temperature", 1.0) >= 0,
        0 < kw.get("top_p", 1.0) <= 1,
        kw.get("top_k", 0) in (0, -1) or kw.get("top_k", 0) >= 1,
        0 <= kw.get("min_p", 0.0) <= 1,
        -2 <= kw.get("presence_penalty", 0.0) <= 2,
        -2 <= kw.get("frequency_penalty", 0.0) <= 2,
        kw.get("repetition_penalty", 1.0) > 0,
        all(k >= 0 and -100 <= v <= 100 for k, v in (kw.get("logit_bias") or {}).items()),
        kw.get("seed") is None or -(2**63) <= kw["seed"] < 2**64,
        max_tokens is None or max_tokens >= 1,
        kw.get("min_tokens", 0) >= 0 and (max_tokens is None or kw.get("min_tokens", 0) <= max_tokens),
        all(s for s in ([kw["stop"]] if isinstance(kw.get("stop"), str) else kw.get("stop", []))),
        all(t >= 0 for t in kw.get("stop_token_ids", [])),
        all(s for s in kw.get("bad_words", [])),
        kw.get("allowed_token_ids") is None or (
            len(kw["allowed_token_ids"]) > 0 and all(t >= 0 for t in kw["allowed_token_ids"])),
        kw.get("logprobs") is None or kw["logprobs"] >= 0,
        kw.get("prompt_logprobs") is None or kw["prompt_logprobs"] >= 0,
        kw.get("logprobs_mode", "raw") in ("raw", "processed", "raw_logits", "processed_logits"),
    ]
    return all(checks)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_field_values)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: _field_values[k] for k in keys})))
def test_random_combinations_construct_iff_valid(kw):
    expected = _expected_valid(kw)
    try:
        SamplingParams(**kw)
    except SamplingParamsError:
        assert not expected, f"valid params rejected: {kw}"
    else:
        assert expected, f"invalid params accepted: {kw}"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(_field_values) + ["include_stop_str_in_output",
                                                "skip_special_tokens", "structured_outputs"]),
       _any_value)
def test_garbage_values_only_ever_raise_sampling_params_error(field, value):
    try:
        p = SamplingParams(**{field: value})
    except SamplingParamsError as e:
        assert e.field == field
    else:
        # Whatever is accepted is transportable.
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


@pytest.mark.parametrize("field", ["n", "best_of", "max_tokens", "seed", "top_k", "logprobs"])
def test_ints_beyond_64_bits_are_rejected_naming_the_field(field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: 2 ** 64})
    assert info.value.field == field
