"""Jump-forward decoding at the grammar: what a grammar forces is found, written in the tokenizer's own
tokenization, and left for the scheduler to accept; where the grammar offers a choice nothing is forced.
Real compiled grammars for the embedded model's tokenizer, no generation."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from tokenloom.scheduler.structured_step import next_token_bitmask
from tokenloom.structured.jump_forward import canonical_tokens, forced_text, forced_tokens
from tokenloom.structured.matcher import StructuredState
from tokenloom.structured.spec import close_objects, normalize_structured_outputs
from tokenloom.structured.thinking import ThinkingTracker
from tokenloom.structured.tool_parsers import HermesToolParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCAFFOLD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'


@pytest.fixture(scope="module")
def backend():
    from tokenloom.model.model_path import embedded_model_path
    from tokenloom.structured.backend import get_backend
    from tokenloom.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(embedded_model_path())
    return get_backend(tok, tok.vocab_size)


def state(backend, so, tracker=None) -> StructuredState:
    ready: Future = Future()
    compiled = backend.compile(normalize_structured_outputs(so))
    ready.set_result((compiled, (lambda: tracker) if tracker is not None else None, backend.tokenizer))
    return StructuredState(ready, backend.stop_token_ids)


def required_call(backend) -> StructuredState:
    tag = HermesToolParser().structural_tag([{"name": "get_weather", "parameters": close_objects(WEATHER)}])
    return state(backend, {"structural_tag": tag})


def newline(backend) -> int:
    return backend.tokenizer.encode("\n", add_special_tokens=False)[0]


def test_a_required_calls_scaffold_is_forced_in_the_tokenizers_own_tokens(backend):
    s = required_call(backend)
    assert forced_text(s) == SCAFFOLD
    tokens = forced_tokens(s, newline(backend), 100)
    assert tokens == backend.tokenizer.encode(SCAFFOLD, add_special_tokens=False)
    assert len(tokens) < len(SCAFFOLD) / 2  # words and punctuation, not characters


def test_finding_the_forced_tokens_leaves_the_grammar_where_it_was(backend):
    s = required_call(backend)
    forced_tokens(s, newline(backend), 100)
    assert forced_text(s) == SCAFFOLD
    assert s.accept(backend.tokenizer.encode("<", add_special_tokens=False)[0]) is None


def test_after_the_scaffold_and_a_value_the_closing_is_forced(backend):
    s = required_call(backend)
    for token in forced_tokens(s, newline(backend), 100) + backend.tokenizer.encode('Paris"', add_special_tokens=False):
        assert s.accept(token) is None
    assert forced_text(s) == "}}\n</tool_call>"


def test_nothing_is_forced_where_the_grammar_offers_a_choice(backend):
    s = state(backend, {"choice": ["yes", "no"]})
    assert forced_text(s) == ""
    assert forced_tokens(s, newline(backend), 100) == []


def test_the_stretch_is_cut_to_the_limit_it_is_given(backend):
    s = required_call(backend)
    full = forced_tokens(s, newline(backend), 100)
    assert forced_tokens(s, newline(backend), 3) == full[:3]
    assert forced_tokens(s, newline(backend), 0) == []


def thinking(backend, prompt: str) -> ThinkingTracker:
    tok = backend.tokenizer
    return ThinkingTracker(tok, "<think>", "</think>", tok.encode(prompt, add_special_tokens=False), None)


def test_nothing_is_forced_until_the_reasoning_is_over(backend):
    reasoning = state(backend, {"json": WEATHER}, thinking(backend, "Question?\n<think>\n"))
    assert forced_tokens(reasoning, newline(backend), 100) == []
    undecided = state(backend, {"json": WEATHER}, thinking(backend, "Question?\n"))
    assert forced_tokens(undecided, newline(backend), 100) == []
    answering = state(backend, {"json": WEATHER}, thinking(backend, "Question?\n<think>\n</think>\n"))
    assert backend.tokenizer.decode(forced_tokens(answering, newline(backend), 100)) == '{"city": "'


def test_a_token_boundary_the_last_token_would_merge_across_falls_back_to_the_forced_text_alone(backend):
    """The sampled token stays as it was (it has been emitted); the forced text keeps its own tokens."""
    tok = backend.tokenizer
    for before, text in (('"', "}"), (" ", "Paris")):
        last = tok.encode(before, add_special_tokens=False)[0]
        assert tok.encode(before + text, add_special_tokens=False)[0] != last  # the two would merge
        assert canonical_tokens(tok, text, last) == tok.encode(text, add_special_tokens=False)


def test_the_first_sample_of_a_forced_output_allows_its_first_canonical_token_only(backend):
    s = required_call(backend)
    first = forced_tokens(s, newline(backend), 1)[0]
    row = torch.frombuffer(bytearray(next_token_bitmask(s, backend.vocab_size, newline(backend))), dtype=torch.int32)
    allowed = [w * 32 + b for w in range(row.numel()) for b in range(32) if (int(row[w]) >> b) & 1]
    assert allowed == [first]


def test_a_free_choice_keeps_the_grammars_whole_bitmask(backend):
    s = state(backend, {"choice": ["yes", "no"]})
    row = torch.frombuffer(bytearray(next_token_bitmask(s, backend.vocab_size, newline(backend))), dtype=torch.int32)
    tok = backend.tokenizer
    for word in ("yes", "no"):
        t = tok.encode(word, add_special_tokens=False)[0]
        assert (int(row[t // 32]) >> (t % 32)) & 1
