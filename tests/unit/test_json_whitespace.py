"""Constrained JSON is compact by default: the grammar allows no free whitespace, so a
small model cannot spend its budget on newlines; `any_whitespace: true` allows it again. Checked on the
compiled grammars for the embedded model's tokenizer (xgrammar matchers, no generation)."""
from __future__ import annotations

import pytest

from tokenloom.structured.spec import normalize_structured_outputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def backend():
    from tokenloom.model.model_path import embedded_model_path
    from tokenloom.structured.backend import get_backend
    from tokenloom.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(embedded_model_path())
    return get_backend(tok, tok.vocab_size)


def accepts(backend, so, text) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(backend.compile(normalize_structured_outputs(so)))
    return matcher.accept_string(text)


@pytest.mark.parametrize("so", [{"json": SCHEMA}, {"json_object": True}])
def test_default_is_compact(backend, so):
    assert accepts(backend, so, '{"city": "Paris"}')
    assert not accepts(backend, so, '{\n  "city": "Paris"}')
    assert not accepts(backend, so, '{"city"  :  "Paris"}')


@pytest.mark.parametrize("so", [{"json": SCHEMA}, {"json_object": True}])
def test_any_whitespace_allows_newlines_and_indentation(backend, so):
    assert accepts(backend, {**so, "any_whitespace": True}, '{\n  "city": "Paris"\n}')


def test_vllm_disable_any_whitespace_is_the_default(backend):
    spec = normalize_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True})
    assert spec == normalize_structured_outputs({"json": SCHEMA})


def test_required_tool_call_grammar_is_compact_and_ends_after_the_calls(backend):
    from tokenloom.structured.tool_parsers import HermesToolParser

    fn = [{"name": "get_weather", "parameters": SCHEMA}]
    tag = {"structural_tag": HermesToolParser().structural_tag(fn, parallel=True)}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(backend, tag, call) and accepts(backend, tag, call + call)
    assert not accepts(backend, tag, call + "\n")  # no separator: after a call, another call or the end
    assert not accepts(backend, tag, call.replace('{"city"', '{\n"city"'))
    single = {"structural_tag": HermesToolParser().structural_tag(fn, parallel=False)}
    assert accepts(backend, single, call) and not accepts(backend, single, call + call)
