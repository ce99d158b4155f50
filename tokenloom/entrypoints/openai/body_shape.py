"""The shape of a JSON request body, measured on its bytes before anything parses it.

Parsing is where a hostile body costs: on 2 shared cores (2026-12-02) `json.loads` of a 15 MB
`chat_template_kwargs` with 800k keys took 1.25 s, pydantic's validation of it 0.7 s more, and each
holds the GIL the whole time, so a thread alone does not keep the event loop answering. `measure`
instead takes the few numbers every limit needs (nesting depth, how many JSON values, each top-level
field's size, values and keys, whether a lone UTF-16 surrogate is escaped anywhere) with a handful of
whole-buffer numpy and bytes operations, each a few milliseconds on a 15 MB body, so the limits in
`body_limits` answer before the parse.

How: escaped backslashes and escaped quotes are overwritten in place (same length, so offsets hold),
the remaining quotes delimit the strings, and a structural byte (``, : [ ] { }``) counts only when an
even number of quotes precede it. A malformed body gives numbers that are merely approximate; the
parser still refuses it afterwards.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

_QUOTE, _COMMA, _COLON, _BACKSLASH = ord('"'), ord(","), ord(":"), ord("\\")
_LOWER_U, _LOWER_D = ord("u"), ord("d")
# Third character of a "\\udXXX" escape (lower-cased): 8-b for a high surrogate, c-f for a low one.
_HIGH_THIRD = np.frombuffer(b"89ab", dtype=np.uint8)
_LOW_THIRD = np.frombuffer(b"cdef", dtype=np.uint8)
_OPEN_ARRAY, _CLOSE_ARRAY, _OPEN_OBJECT, _CLOSE_OBJECT = ord("["), ord("]"), ord("{"), ord("}")
_STRUCTURAL = np.zeros(256, dtype=bool)
_STRUCTURAL[list(b",:[]{}")] = True


# No API's body has more top-level fields than this; past it the members are counted, not measured.
MAX_MEASURED_FIELDS = 512


@dataclass(frozen=True)
class FieldShape:
    """One member of the top-level object."""

    name: str
    nbytes: int  # its value's raw bytes, whitespace included
    values: int  # JSON values in it (an estimate from below: elements + containers)
    keys: int  # keys of its value when that is an object (the object's own, not nested ones)


@dataclass(frozen=True)
class BodyShape:
    depth: int  # deepest nesting of arrays / objects
    values: int  # JSON values in the whole body
    num_fields: int  # members of the top-level object (0 when the body is not one)
    fields: tuple[FieldShape, ...]  # those members, measured when there are at most `MAX_MEASURED_FIELDS`
    lone_surrogate: bool  # a "\\udXXX" escape that does not form a pair somewhere (a key, a value)


def measure(body: bytes) -> BodyShape:
    arr = np.frombuffer(body, dtype=np.uint8)
    quotes = np.flatnonzero(arr == _QUOTE)
    escapes, lone = _escapes(arr, quotes)
    if escapes is not None:
        quotes = quotes[~escapes]
    pos = np.flatnonzero(_STRUCTURAL[arr])
    if len(quotes) and len(pos):
        pos = pos[(np.searchsorted(quotes, pos) & 1) == 0]
    if not len(pos):
        return BodyShape(depth=0, values=1, num_fields=0, fields=(), lone_surrogate=lone)
    ch = arr[pos]
    opens = (ch == _OPEN_ARRAY) | (ch == _OPEN_OBJECT)
    closes = (ch == _CLOSE_ARRAY) | (ch == _CLOSE_OBJECT)
    level = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32))  # nesting after each byte
    counted = opens | (ch == _COMMA)
    depth = int(level.max())
    values = int(np.count_nonzero(counted)) + 1
    num_fields = 0
    fields: tuple[FieldShape, ...] = ()
    if ch[0] == _OPEN_OBJECT and not body[:pos[0]].strip() and int(level.min()) >= 0:
        num_fields = int(np.count_nonzero((ch == _COLON) & (level == 1)))
        if num_fields <= MAX_MEASURED_FIELDS:
            fields = _top_level_fields(body, pos, ch, level, counted, quotes)
    return BodyShape(depth=depth, values=values, num_fields=num_fields, fields=fields, lone_surrogate=lone)


def _escapes(arr: np.ndarray, quotes: np.ndarray) -> tuple[np.ndarray | None, bool]:
    """(which quotes are escaped, or None when none is; whether a lone surrogate is escaped).

    A backslash starts an escape when it sits at an even offset in its run of backslashes; a quote is
    escaped when the run right before it has odd length."""
    slashes = np.flatnonzero(arr == _BACKSLASH)
    if not len(slashes):
        return None, False
    run_begins = np.ones(len(slashes), dtype=bool)
    run_begins[1:] = np.diff(slashes) != 1
    run_start = slashes[np.maximum.accumulate(np.where(run_begins, np.arange(len(slashes)), 0))]
    before = np.searchsorted(slashes, quotes) - 1
    safe = np.maximum(before, 0)
    escaped = (before >= 0) & (slashes[safe] == quotes - 1) & ((quotes - run_start[safe]) % 2 == 1)
    starts = slashes[(slashes - run_start) % 2 == 0]
    starts = starts[starts + 3 < len(arr)]
    is_u = (arr[starts + 1] == _LOWER_U) & ((arr[starts + 2] | 0x20) == _LOWER_D)
    starts, third = starts[is_u], arr[starts[is_u] + 3] | 0x20
    high = starts[np.isin(third, _HIGH_THIRD)]
    low = starts[np.isin(third, _LOW_THIRD)]
    lone = not (np.isin(high + 6, low).all() and np.isin(low - 6, high).all())
    return (escaped if escaped.any() else None), lone


def _top_level_fields(body: bytes, pos: np.ndarray, ch: np.ndarray, level: np.ndarray, counted: np.ndarray,
                      quotes: np.ndarray) -> tuple[FieldShape, ...]:
    colons = np.flatnonzero((ch == _COLON) & (level == 1))  # indices into pos
    ends = np.flatnonzero(((ch == _COMMA) & (level == 1)) | (level == 0))
    if not len(colons) or not len(ends):
        return ()
    end_of = ends[np.minimum(np.searchsorted(ends, colons), len(ends) - 1)]
    counted_sum = np.cumsum(counted)
    own_keys_sum = np.cumsum((ch == _COLON) & (level == 2))
    value_count = counted_sum[end_of - 1] - counted_sum[colons] + 1
    key_count = own_keys_sum[end_of - 1] - own_keys_sum[colons]
    key_quote = np.searchsorted(quotes, pos[colons])
    out = []
    for i, colon in enumerate(colons):
        q = int(key_quote[i])
        name = _key_name(body[quotes[q - 2] + 1:quotes[q - 1]]) if q >= 2 else ""
        out.append(FieldShape(name=name, nbytes=int(pos[end_of[i]] - pos[colon] - 1), values=int(value_count[i]),
                              keys=int(key_count[i])))
    return tuple(out)


def _key_name(raw: bytes) -> str:
    try:
        name = json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")
    return name if isinstance(name, str) else ""
