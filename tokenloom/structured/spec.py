"""`SamplingParams.structured_outputs` dict -> one normalized, hashable `GrammarSpec`.

Accepted keys (vLLM names): exactly one constraint of ``json`` (schema dict or JSON text),
``json_object`` (true), ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF / GBNF),
``structural_tag`` (dict or JSON text); options ``strict`` (JSON schema: no properties or items
beyond the schema's) and ``any_whitespace``. JSON is compact by default (one space after ``,``
and ``:``, no other whitespace): a small model given free whitespace spends its token budget on
newlines and indentation and the JSON never closes. ``any_whitespace: true`` restores free
(bounded) whitespace; vLLM's ``disable_any_whitespace`` is accepted and is the default. Schemas are
checked here (JSON Schema validity, and features xgrammar would silently not enforce), before
anything is compiled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.structured.errors import StructuredOutputError

CONSTRAINT_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
OPTION_KEYS = ("strict", "any_whitespace", "disable_any_whitespace", "disable_additional_properties")
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 4096

# JSON Schema keywords xgrammar accepts but does not enforce: rejected rather than silently ignored.
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
               "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType", "contentSchema")
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical text form; `key` identifies its compiled grammar."""

    kind: str  # json | json_object | regex | choice | grammar | structural_tag
    spec: str  # canonical JSON text for json / choice / structural_tag, else the source text
    strict: bool = False
    any_whitespace: bool = True

    @property
    def key(self) -> tuple:
        return (self.kind, self.spec, self.strict, self.any_whitespace)


def normalize_structured_outputs(so: JsonObject | None, param: str = "structured_outputs",
                                 where: str | None = None) -> GrammarSpec | None:
    """Validate and canonicalize; None when the dict holds no constraint. Errors name `param` (the request
    field) and say `where` the constraint sits (default ``param.kind``)."""
    if not so:
        return None
    if not isinstance(so, dict):
        raise StructuredOutputError(f"{param} must be an object, got {type(so).__name__}", param)
    unknown = [k for k in so if k not in CONSTRAINT_KEYS and k not in OPTION_KEYS]
    if unknown:
        raise StructuredOutputError(f"{param}: unknown key {unknown[0]!r} (constraints: "
                                    f"{', '.join(CONSTRAINT_KEYS)}; options: {', '.join(OPTION_KEYS)})", param)
    given = [k for k in CONSTRAINT_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise StructuredOutputError(f"{param}: give exactly one constraint, got {len(given)} "
                                    f"({', '.join(given)})", param)
    if not given:
        return None
    kind = given[0]
    value = so[kind]
    where = where or f"{param}.{kind}"
    strict = bool(so.get("strict", False) or so.get("disable_additional_properties", False))
    any_ws = so.get("any_whitespace") is True and not so.get("disable_any_whitespace", False)
    if kind == "json":
        schema = _load_json(value, where, "a JSON schema (object or JSON text)")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
        check_schema(schema, where)
        return GrammarSpec("json", _canonical(close_objects(schema)), strict, any_ws)
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(f"{where} must be true, got {value!r}", where)
        return GrammarSpec("json_object", "", False, any_ws)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value.strip():
            raise StructuredOutputError(f"{where} must be a non-empty string", where)
        _check_size(value, where)
        return GrammarSpec(kind, value)
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise StructuredOutputError(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings", where)
        text = json.dumps(list(dict.fromkeys(value)), ensure_ascii=False)
        _check_size(text, where)
        return GrammarSpec("choice", text)
    tag = _load_json(value, where, "a structural tag (object or JSON text)")
    if not isinstance(tag, dict):
        raise StructuredOutputError(f"{where} must be an object", where)
    return GrammarSpec("structural_tag", _canonical(legacy_structural_tag(tag)))


def legacy_structural_tag(tag: JsonObject) -> JsonObject:
    """vLLM's older ``{"structures": [{begin, schema, end}], "triggers": [...]}`` -> xgrammar's format."""
    if "structures" not in tag:
        return tag
    tags = [{"type": "tag", "begin": s.get("begin", ""), "end": s.get("end", ""),
             "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
            for s in tag.get("structures") or ()]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": list(tag.get("triggers") or ()), "tags": tags}}


def _canonical(obj: JsonValue) -> str:
    # Key order is kept: xgrammar emits object properties in the schema's order.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def close_objects(node: JsonValue) -> JsonValue:
    """A copy where every object schema that lists `properties` and says nothing about other properties
    gets ``additionalProperties: false`` (outputs stay valid for the original schema; a weak model cannot
    wander into invented keys). Objects without `properties` stay open."""
    if isinstance(node, list):
        return [close_objects(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("const", "enum", "default", "examples") else close_objects(v)) for k, v in node.items()}
    if isinstance(node.get("properties"), dict) and not any(
            k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _check_size(text: str, where: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"{where} is too large: {len(text)} characters, the limit is {MAX_SPEC_CHARS}",
                                    where)


def _load_json(value: JsonValue, where: str, expected: str) -> JsonValue:
    if isinstance(value, str):
        _check_size(value, where)
        try:
            return json.loads(value)
        except ValueError as e:
            raise StructuredOutputError(f"{where} is not valid JSON: {e}", where) from None
    if isinstance(value, (dict, bool)):
        _check_size(_canonical(value), where)
        return value
    raise StructuredOutputError(f"{where} must be {expected}, got {type(value).__name__}", where)


def check_schema(schema: JsonObject, where: str) -> None:
    """A valid JSON Schema (checked with `jsonschema` when installed) that xgrammar fully enforces."""
    try:
        import jsonschema  # lazy: optional; without it xgrammar still reports gross errors
    except ImportError:  # pragma: no cover - optional; xgrammar still reports gross errors
        jsonschema = None
    if jsonschema is not None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            path = "".join(f"/{p}" for p in e.path)
            raise StructuredOutputError(f"{where} is not a valid JSON schema: at #{path}: {e.message}",
                                        where) from None
    _check_enforceable(schema, "#", where)


def _check_enforceable(node: JsonValue, path: str, where: str) -> None:
    if not isinstance(node, dict):
        return

    def fail(what: str) -> None:
        raise StructuredOutputError(f"{where}: {what} at {path} is not supported by the grammar backend "
                                    f"(it could not be enforced)", where)

    for kw in _UNENFORCED:
        if kw in node:
            fail(f"keyword {kw!r}")
    if node.get("uniqueItems") is True:
        fail("'uniqueItems': true")
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type", "string") == "string" and fmt not in _FORMATS:
        fail(f"format {fmt!r}")
    mult = node.get("multipleOf")
    if mult is not None and not (isinstance(mult, int) or (isinstance(mult, float) and mult.is_integer())):
        fail(f"non-integer multipleOf {mult!r}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        fail("'allOf' with more than one schema")
    for key in _SUBSCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                _check_enforceable(s, f"{path}/{key}/{name}", where)
    for key in _SUBSCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                _check_enforceable(s, f"{path}/{key}/{i}", where)
    for key in _SUBSCHEMA_ONE:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                _check_enforceable(s, f"{path}/{key}/{i}", where)
        else:
            _check_enforceable(sub, f"{path}/{key}", where)
