"""The raw-bytes measure of a JSON body (body_shape.measure) agrees with what the parser sees.

Random bodies whose strings hold every character that could fool a byte scan (quotes, backslashes,
brackets, commas, colons, escaped surrogate pairs, raw UTF-8) are measured and compared with the
same numbers computed from `json.loads` of the body.
"""
from __future__ import annotations

import json
import random

import pytest

from tokenloom.entrypoints.openai.body_shape import MAX_MEASURED_FIELDS, measure
from tokenloom.entrypoints.openai.limits import lone_surrogate

_TRICKY = ['"', "\\", "\\\\", '\\"', "[", "]", "{", "}", ",", ":", "a", " ", "é", "😀", "\n", "\\u", "ud800"]


def _text(rng: random.Random, lone: bool) -> str:
    s = "".join(rng.choice(_TRICKY) for _ in range(rng.randint(0, 8)))
    if lone and rng.random() < 0.2:
        s += rng.choice(["\ud800", "\udfff", "\udbff\udbff"])
    return s


def _value(rng: random.Random, depth: int, lone: bool):
    kind = rng.random()
    if depth > 5 or kind < 0.4:
        return rng.choice([1, -2.5, True, None, _text(rng, lone), _text(rng, lone)])
    if kind < 0.7:
        return [_value(rng, depth + 1, lone) for _ in range(rng.randint(0, 4))]
    return {_text(rng, lone): _value(rng, depth + 1, lone) for _ in range(rng.randint(0, 4))}


def _depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    return 0


def _values(v) -> int:
    """Commas and opening brackets, plus one: what measure counts."""
    def inner(x) -> int:
        if isinstance(x, dict):
            return 1 + max(len(x) - 1, 0) + sum(inner(y) for y in x.values())
        if isinstance(x, list):
            return 1 + max(len(x) - 1, 0) + sum(inner(y) for y in x)
        return 0
    return inner(v) + 1


@pytest.mark.parametrize("seed", range(4))
def test_measure_agrees_with_the_parsed_body(seed):
    rng = random.Random(seed)
    for _ in range(150):
        lone = rng.random() < 0.3
        body = {_text(rng, lone): _value(rng, 1, lone) for _ in range(rng.randint(0, 6))}
        ascii_only = lone or rng.random() < 0.5  # a lone surrogate can only travel escaped
        raw = json.dumps(body, ensure_ascii=ascii_only, separators=(",", ":")).encode()
        shape = measure(raw)
        parsed = json.loads(raw)
        assert shape.depth == _depth(parsed), raw
        assert shape.values == _values(parsed), raw
        assert shape.num_fields == len(parsed)
        assert [f.name for f in shape.fields] == list(parsed), raw
        for field in shape.fields:
            value = parsed[field.name]
            assert field.nbytes == len(json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":")).encode()), raw
            assert field.values == _values(value), raw
            assert field.keys == (len(value) if isinstance(value, dict) else 0), raw
        assert shape.lone_surrogate == (lone_surrogate(parsed) is not None), raw


def test_whitespace_counts_in_a_fields_bytes():
    shape = measure(b'{ "a" :  [1, 2] , "b": {"k": 1}}')
    assert [(f.name, f.nbytes, f.values, f.keys) for f in shape.fields] == [("a", 9, 3, 0), ("b", 9, 2, 1)]


def test_a_surrogate_pair_is_text_and_a_lone_half_is_not():
    assert not measure(b'{"p": "\\ud83d\\ude00"}').lone_surrogate
    assert measure(b'{"p": "\\ud83d"}').lone_surrogate
    assert measure(b'{"p": "x\\ude00"}').lone_surrogate
    assert measure(b'{"k\\udc00": 1}').lone_surrogate
    assert not measure(b'{"p": "\\\\ud800"}').lone_surrogate  # an escaped backslash, then text


def test_a_body_that_is_not_an_object_has_no_fields():
    assert measure(b"[1, 2, 3]").fields == ()
    assert measure(b'"text"').num_fields == 0


def test_past_the_measured_limit_fields_are_counted_not_measured():
    body = json.dumps({f"k{i}": i for i in range(MAX_MEASURED_FIELDS + 1)}).encode()
    shape = measure(body)
    assert shape.num_fields == MAX_MEASURED_FIELDS + 1 and shape.fields == ()
