"""Limits on hostile or accidental oversized input, checked before any real work.

Each limit answers 400 (413 for the body size, see body_guard.BodyGuardMiddleware) with a
message giving the limit and `param` naming the field:

* JSON nesting depth of the body (`MAX_JSON_DEPTH`), measured on the raw bytes before
  parsing (body_limits.py, with the other limits on the raw body), so a deeply nested body
  never reaches a recursive parser;
* structured-output specs (`response_format`, `structured_outputs`, `guided_*`, tool
  schemas): serialized size (`MAX_SCHEMA_BYTES`), grammar size (`MAX_GRAMMAR_CHARS`),
  choice lists, and regexes: length (`MAX_REGEX_CHARS`), syntax, and complexity: the
  number of automaton states a bounded repeat expands to (`a{1000}{1000}`) is capped
  (`MAX_REGEX_EXPANDED`), as are nested unbounded repeats (`(a+)+`, `MAX_REGEX_STAR_NESTING`);
* `max_tokens` above the model's context length (it can never be served; a value that
  only overflows together with the prompt is clamped to the room left, as before);
* prompt text so long that it cannot fit the context whatever the tokenizer
  (`MAX_CHARS_PER_TOKEN` characters per token), rejected before tokenizing it.

Other limits live where their data is: message count, content parts, stop / logit_bias /
token lists in protocol.py, `n`, logprobs, stop sequences, logit_bias and bad_words
against the engine config in `SamplingParams.validate_limits`, the context length in
the InputProcessor, the body size in the body guard, the body's shape before parsing in body_limits.py.
"""
from __future__ import annotations

import json
import re
import re._parser as sre_parse  # Python >= 3.11

from pydantic import BaseModel

from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

MAX_JSON_DEPTH = 64
MAX_SCHEMA_BYTES = 64 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_REGEX_EXPANDED = 20_000
MAX_REGEX_STAR_NESTING = 2
MAX_CHOICES = 1024
MAX_CHARS_PER_TOKEN = 64

_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                      "guided_choice", "structural_tag", "grammar", "json_schema", "tools")


# ------------------------------------------------------------------ helpers

def _depth(obj: object, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed value (iterative; stops counting past `limit`)."""
    best = 0
    stack = [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        best = max(best, d)
        if best > limit:
            return best
        stack.extend((c, d + 1) for c in children)
    return best


def _size(obj: object) -> int:
    try:
        return len(json.dumps(obj, separators=(",", ":"), default=str))
    except (TypeError, ValueError, RecursionError):
        return 1 << 30


def _too_big(param: str, what: str, size: int, limit: int) -> BadRequestError:
    return BadRequestError(f"{param}: {what} is {size} bytes; the limit is {limit}", param=param,
                           code="request_too_large")


# ------------------------------------------------------------------ regex complexity

def check_regex(pattern: object, param: str) -> None:
    """Reject regexes that are too long, invalid, or would compile to a huge automaton."""
    if not isinstance(pattern, str):
        raise BadRequestError(f"{param}: a regex must be a string", param=param, code="invalid_value")
    if len(pattern) > MAX_REGEX_CHARS:
        raise BadRequestError(f"{param}: the regex has {len(pattern)} characters; the limit is {MAX_REGEX_CHARS}",
                              param=param, code="regex_too_complex")
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise BadRequestError(f"{param}: invalid regex: {e}", param=param, code="invalid_value") from None
    maxrepeat = sre_parse.MAXREPEAT

    def cost(items: sre_parse.SubPattern, star_depth: int) -> int:
        total = 0
        for op, av in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                unbounded = hi == maxrepeat
                if unbounded and star_depth + 1 > MAX_REGEX_STAR_NESTING:
                    raise BadRequestError(f"{param}: the regex nests unbounded repeats more than "
                                          f"{MAX_REGEX_STAR_NESTING} deep", param=param, code="regex_too_complex")
                copies = max(lo, 1) if unbounded else max(hi, 1)
                total += copies * cost(sub, star_depth + (1 if unbounded else 0))
            elif name == "SUBPATTERN":
                total += cost(av[-1], star_depth)
            elif name == "BRANCH":
                total += sum(cost(alt, star_depth) for alt in av[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += cost(av[1], star_depth)
            elif name == "GROUPREF_EXISTS":
                total += cost(av[1], star_depth) + (cost(av[2], star_depth) if av[2] else 0)
            else:
                total += 1
            if total > MAX_REGEX_EXPANDED:
                raise BadRequestError(f"{param}: the regex expands to more than {MAX_REGEX_EXPANDED} states "
                                      f"(bounded repeats multiply)", param=param, code="regex_too_complex")
        return total

    cost(parsed, 0)


# ------------------------------------------------------------------ request checks

def _check_structured(name: str, value: object) -> None:
    if value is None:
        return
    if _depth(value) > MAX_JSON_DEPTH:
        raise BadRequestError(f"{name}: nested deeper than {MAX_JSON_DEPTH} levels", param=name,
                              code="nesting_too_deep")
    if isinstance(value, dict):
        for key in ("regex", "pattern"):
            if isinstance(value.get(key), str):
                check_regex(value[key], f"{name}.{key}")
        for key in ("grammar", "ebnf", "lark"):
            g = value.get(key)
            if isinstance(g, str) and len(g) > MAX_GRAMMAR_CHARS:
                raise BadRequestError(f"{name}.{key}: the grammar has {len(g)} characters; the limit is "
                                      f"{MAX_GRAMMAR_CHARS}", param=f"{name}.{key}", code="request_too_large")
        choice = value.get("choice")
        if isinstance(choice, list) and len(choice) > MAX_CHOICES:
            raise BadRequestError(f"{name}.choice: {len(choice)} choices; the limit is {MAX_CHOICES}",
                                  param=f"{name}.choice", code="request_too_large")
        # JSON-schema "pattern" keywords anywhere in the schema are regexes too.
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                p = v.get("pattern")
                if isinstance(p, str) and v is not value:
                    check_regex(p, f"{name} (schema pattern)")
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    size = _size(value)
    if size > MAX_SCHEMA_BYTES:
        raise _too_big(name, "the schema / grammar spec", size, MAX_SCHEMA_BYTES)
    if isinstance(value, str) and name == "guided_regex":
        check_regex(value, name)
    elif isinstance(value, list) and len(value) > MAX_CHOICES:
        raise BadRequestError(f"{name}: {len(value)} entries; the limit is {MAX_CHOICES}", param=name,
                              code="request_too_large")


def check_request_limits(request: ChatCompletionRequest | CompletionRequest | TokenizeRequest,
                         max_model_len: int | None = None) -> None:
    """Every limit a chat / completion request body can break (raises BadRequestError)."""
    for name in _STRUCTURED_FIELDS:
        _check_structured(name, getattr(request, name, None))
    kwargs = getattr(request, "chat_template_kwargs", None)
    if kwargs is not None and _depth(kwargs) > MAX_JSON_DEPTH:
        raise BadRequestError(f"chat_template_kwargs: nested deeper than {MAX_JSON_DEPTH} levels",
                              param="chat_template_kwargs", code="nesting_too_deep")
    if max_model_len:
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(request, name, None)
            if v is not None and v > max_model_len:
                raise BadRequestError(f"{name} is {v}, more than the model's context length of {max_model_len} "
                                      f"tokens", param=name, code="invalid_value")
        limit = max_model_len * MAX_CHARS_PER_TOKEN
        prompt = getattr(request, "prompt", None)
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)] \
            if isinstance(prompt, list) else []
        for m in getattr(request, "messages", None) or ():
            content = m.content
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(part.get("text", "") for part in content if isinstance(part, dict))
        total = sum(len(t) for t in texts if isinstance(t, str))
        if total > limit:
            param = "prompt" if prompt is not None else "messages"
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has {total} "
                f"characters, more than any {max_model_len}-token prompt could have", param=param,
                code="context_length_exceeded")


# ------------------------------------------------------------------ text encoding

def lone_surrogate(value: object) -> tuple[str | None, bool] | None:
    """(path, whether it is a key) of the first string holding a lone UTF-16 surrogate, or None. JSON
    allows "\\ud800"; UTF-8 cannot encode it, so the tokenizer and the response writer would fail.
    Walks dicts, lists and request models (their extra fields too), keys included; iterative."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                return p or None, False
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and not _is_text(k):
                    return p or None, True
                stack.append((x, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, BaseModel):
            fields = dict(v.__dict__)
            fields.update(v.__pydantic_extra__ or {})
            stack.append((fields, p))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(request: BaseModel) -> None:
    """400 naming the field when any string of the request, or any key, is not valid Unicode text."""
    found = lone_surrogate(request)
    if found is not None:
        path, in_key = found
        what = "a key" if in_key else "the string"
        raise BadRequestError(f"{path or 'request'}: {what} contains a lone UTF-16 surrogate (not valid Unicode "
                              f"text)", param=path, code="invalid_value")
