"""Other engines' spellings of an output constraint map to the same constraint as vLLM's names
(structured.py): llama.cpp's `grammar` is guided_grammar, its `json_schema` is guided_json, and OpenAI's
`{"name", "schema"}` wrapper sent there is unwrapped."""
from __future__ import annotations

from tokenloom.entrypoints.openai.protocol import CompletionRequest
from tokenloom.entrypoints.openai.structured import _constraints

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}}


def _only(body: dict) -> tuple[str, dict, str | None]:
    found = _constraints(CompletionRequest.model_validate({"prompt": "hi", **body}))
    assert len(found) == 1, found
    return found[0]


def test_grammar_is_guided_grammar():
    assert _only({"grammar": 'root ::= "a"'})[1] == _only({"guided_grammar": 'root ::= "a"'})[1]


def test_json_schema_is_guided_json():
    assert _only({"json_schema": SCHEMA})[1] == _only({"guided_json": SCHEMA})[1] == {"json": SCHEMA}


def test_json_schema_in_response_formats_wrapper_is_unwrapped():
    field, constraint, where = _only({"json_schema": {"name": "person", "schema": SCHEMA}})
    assert (field, constraint, where) == ("json_schema", {"json": SCHEMA}, "json_schema.schema")


def test_both_spellings_together_are_two_constraints():
    request = CompletionRequest.model_validate({"prompt": "hi", "guided_grammar": "x", "grammar": "y"})
    assert [f for f, _, _ in _constraints(request)] == ["guided_grammar", "grammar"]
