"""Build a `tokenizers.Tokenizer` from the tokenizer metadata of a GGUF file."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from tokenloom.core.json_types import JsonObject, JsonValue

logger = logging.getLogger(__name__)

_CONTROL = 3
_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe", "lfm2"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
_GPT2_PRES = {None, "default", "gpt2", "gpt-2", "starcoder", "refact", "olmo", "jais"}

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@dataclass
class GGUFTokenizerInfo:
    """What a loader needs besides the tokenizer itself."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    def to_json(self) -> JsonObject:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: JsonObject) -> "GGUFTokenizerInfo":
        return cls(**data)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_pre_tokenizer(pre: str | None) -> JsonObject:
    if pre == "smollm":
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
    if pre in _SPLITS:
        split = {"type": "Split", "pattern": {"Regex": _SPLITS[pre]}, "behavior": "Isolated", "invert": False}
        return {"type": "Sequence", "pretokenizers": [split, {**_BYTE_LEVEL, "use_regex": False}]}
    if pre not in _GPT2_PRES:
        logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2 byte-level splitting", pre)
    return _BYTE_LEVEL


def _bpe_model(vocab: dict[str, int], merges: list[list[str]], **extra: JsonValue) -> JsonObject:
    return {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
        "vocab": vocab, "merges": merges, **extra,
    }


def _parse_merges(merges: list[str]) -> list[list[str]]:
    return [m.split(" ", 1) for m in merges]


def _derive_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[list[str]]:
    """Merges implied by a SentencePiece vocabulary: best-scoring tokens merge first."""
    ranked = []
    for token, score in zip(tokens, scores):
        local = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, left, right) for left, right in local)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [[left, right] for _, left, right in ranked]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _byte_level(md: dict[str, JsonValue], tokens: list[str]) -> JsonObject:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    merges = md.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("byte-level BPE vocabulary has no merges")
    return {
        "normalizer": None,
        "pre_tokenizer": _byte_pre_tokenizer(md.get("tokenizer.ggml.pre")),
        "decoder": {**_BYTE_LEVEL, "add_prefix_space": True},
        "model": _bpe_model(_vocab(spelled), _parse_merges(merges)),
    }


def _sentencepiece(md: dict[str, JsonValue], tokens: list[str]) -> JsonObject:
    vocab = _vocab(tokens)
    if "tokenizer.ggml.merges" in md:
        merges = _parse_merges(md["tokenizer.ggml.merges"])
    elif "tokenizer.ggml.scores" in md:
        merges = _derive_merges(tokens, md["tokenizer.ggml.scores"], vocab)
    else:
        raise ValueError("SentencePiece vocabulary has neither merges nor scores")
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    decoder: list[JsonObject] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first" if prefix else "never",
            "split": False,
        },
        "decoder": {"type": "Sequence", "decoders": decoder},
        "model": _bpe_model(
            vocab, merges, fuse_unk=True, byte_fallback=True,
            unk_token=tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None,
        ),
    }


def _added_tokens(tokens: list[str], types: list[int]) -> list[JsonObject]:
    return [
        {
            "id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": t == _CONTROL,
        }
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED) and i < len(tokens)
    ]


def _optional_id(md: dict[str, JsonValue], key: str, n_tokens: int) -> int | None:
    value = md.get(f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < n_tokens:
        return None
    return int(value)


def build_gguf_tokenizer(md: dict[str, JsonValue]) -> tuple[HFTokenizer, GGUFTokenizerInfo]:
    """Build the tokenizer described by GGUF metadata `md` (keys `tokenizer.*`).

    Raises ValueError when the metadata does not describe a supported tokenizer.
    """
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ValueError("no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind == "gpt2":
        spec = _byte_level(md, tokens)
    elif kind == "llama":
        spec = _sentencepiece(md, tokens)
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")
    n = len(tokens)
    info = GGUFTokenizerInfo(
        bos_token_id=_optional_id(md, "bos_token_id", n),
        eos_token_id=_optional_id(md, "eos_token_id", n),
        pad_token_id=_optional_id(md, "padding_token_id", n),
        unk_token_id=_optional_id(md, "unknown_token_id", n),
        add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        chat_template=md.get("tokenizer.chat_template"),
    )
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokens, md.get("tokenizer.ggml.token_type") or []),
        "post_processor": None, **spec,
    }
    try:
        inner = HFTokenizer.from_str(json.dumps(spec))
    except Exception as e:
        raise ValueError(f"tokenizers rejected the vocabulary: {e}") from e
    _set_special_post_processor(inner, info, tokens, add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)))
    return inner, info


def _set_special_post_processor(
    inner: HFTokenizer, info: GGUFTokenizerInfo, tokens: list[str], add_eos: bool
) -> None:
    pieces: list[tuple[str, int]] = []
    single, pair = "$A:0", "$A:0 $B:1"
    if info.add_bos_token and info.bos_token_id is not None:
        bos = tokens[info.bos_token_id]
        pieces.append((bos, info.bos_token_id))
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
    if add_eos and info.eos_token_id is not None:
        eos = tokens[info.eos_token_id]
        pieces.append((eos, info.eos_token_id))
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
    if pieces:
        inner.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(pieces))
        )
