"""The <think> reasoning parser on scripted outputs: whole and streamed splits agree."""
from __future__ import annotations

import pytest

from tokenloom.structured.reasoning import ThinkReasoningParser, get_reasoning_parser
from tokenloom.structured.thinking import ANSWER, REASONING, UNDECIDED, prompt_phase

CASES = [
    # (prompt, output, reasoning, content)
    ("", "<think>\nplan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("", "  <think>a</think>b", "a", "b"),
    ("", "No thinking here.", None, "No thinking here."),
    ("", "<think>never closed", "never closed", ""),
    ("<|im_start|>assistant\n<think>\n", "step 1</think>done", "step 1", "done"),
    ("<think>\n\n</think>\n\n", "plain <think> text", None, "plain <think> text"),
    ("", "<thinking is not a marker", None, "<thinking is not a marker"),
    ("", "", None, ""),
]


@pytest.mark.parametrize("prompt,output,reasoning,content", CASES)
def test_extract(prompt, output, reasoning, content):
    assert ThinkReasoningParser(prompt).extract(output) == (reasoning, content)


@pytest.mark.parametrize("prompt,output,reasoning,content", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_stream_matches_extract(prompt, output, reasoning, content, step):
    parser = ThinkReasoningParser(prompt)
    got_r = got_c = ""
    for i in range(0, len(output), step):
        r, c = parser.feed(output[i:i + step])
        got_r, got_c = got_r + r, got_c + c
    r, c = parser.finish()
    got_r, got_c = got_r + r, got_c + c
    assert (got_r, got_c) == (reasoning or "", content)


def test_marker_not_leaked_while_streaming():
    parser = ThinkReasoningParser("")
    seen = []
    for piece in ["<th", "ink>", "idea</", "thi", "nk>", "ok"]:
        seen.append(parser.feed(piece))
    assert all("<" not in r and "<" not in c for r, c in seen)
    assert "".join(r for r, _ in seen) == "idea" and "".join(c for _, c in seen) == "ok"


def test_prompt_phase_and_registry():
    assert prompt_phase("x<think>\n", "<think>", "</think>") == REASONING
    assert prompt_phase("<think></think>", "<think>", "</think>") == ANSWER
    assert prompt_phase("hello", "<think>", "</think>") == UNDECIDED
    assert get_reasoning_parser("qwen3") is ThinkReasoningParser
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
