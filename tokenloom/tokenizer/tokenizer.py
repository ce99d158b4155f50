"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens and chat template."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.tokenizer.chat_template import ChatTemplateError, render_chat_template
from tokenloom.tokenizer.gguf_builder import GGUFTokenizerInfo, build_gguf_tokenizer
from tokenloom.tokenizer.gguf_metadata import read_gguf_metadata

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1


class TokenizerError(RuntimeError):
    """A tokenizer could not be loaded or built."""


def cache_dir() -> Path:
    """Where built tokenizers are cached (`$TOKENLOOM_CACHE_DIR`, default `~/.cache/tokenloom`)."""
    return Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom") / "tokenizers"


def gguf_cache_key(path: str | os.PathLike[str]) -> str:
    """Key a GGUF file by its absolute path, size and mtime (and the cache format)."""
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _token_content(value: JsonValue) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> JsonObject:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e


def _as_id_list(value: JsonValue) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        inner: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        self.inner = inner
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids or []))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.vocab_size: int = inner.get_vocab_size(with_added_tokens=True)
        named = {bos_token_id, pad_token_id, unk_token_id, *self.eos_token_ids} - {None}
        added = {i for i, tok in inner.get_added_tokens_decoder().items() if tok.special}
        self.all_special_ids: set[int] = added | named  # type: ignore[operator]

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load from a GGUF file, an HF-style folder, or a folder holding a single GGUF file."""
        p = Path(path)
        if p.is_file():
            return cls.from_gguf(p)
        if p.is_dir():
            if (p / "tokenizer.json").is_file():
                return cls.from_folder(p)
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0])
            raise TokenizerError(f"cannot load tokenizer from {p}: no tokenizer.json and not exactly one .gguf file")
        raise TokenizerError(f"cannot load tokenizer from {p}: no such file or directory")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build from a GGUF file's metadata; the result is cached on disk for warm starts."""
        path = os.fspath(path)
        try:
            key = gguf_cache_key(path)
        except OSError as e:
            raise TokenizerError(f"cannot build tokenizer from {path}: {e.strerror or e}") from e
        cached = _load_cached(key)
        if cached is None:
            try:
                inner, info = build_gguf_tokenizer(read_gguf_metadata(path, "tokenizer."))
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                raise TokenizerError(f"cannot build tokenizer from {path}: {e}") from e
            _store_cached(key, inner, info)
        else:
            inner, info = cached
        return cls(
            inner,
            bos_token_id=info.bos_token_id,
            eos_token_ids=[info.eos_token_id] if info.eos_token_id is not None else [],
            pad_token_id=info.pad_token_id,
            unk_token_id=info.unk_token_id,
            chat_template=info.chat_template,
            name=path,
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load an HF-style folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"cannot load tokenizer from {folder}: tokenizer.json not found")
        try:
            inner = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerError(f"cannot load tokenizer from {tok_file}: {e}") from e
        # A file's batch settings (all-MiniLM-L6-v2's pads and truncates to 128): tokenloom encodes one text at a
        # time and refuses over-long inputs itself, never silently cutting them.
        inner.no_padding()
        inner.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        _add_config_tokens(inner, config)

        def token_id(name: str) -> int | None:
            content = _token_content(config.get(name))
            return inner.token_to_id(content) if content is not None else None

        bos_id = token_id("bos_token")
        eos_ids = [token_id("eos_token")]
        if eos_ids[0] is None:
            eos_ids = _as_id_list(model_config.get("eos_token_id"))
        eos_ids += _as_id_list(gen_config.get("eos_token_id"))
        if bos_id is None and "bos_token" not in config:
            bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        _apply_add_special_flags(inner, config, bos_id, eos_ids[0] if eos_ids else None)
        pad_id = token_id("pad_token")
        if pad_id is None:
            pad_id = gen_config.get("pad_token_id", model_config.get("pad_token_id"))
        return cls(
            inner,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            pad_token_id=pad_id if isinstance(pad_id, int) else None,
            unk_token_id=token_id("unk_token"),
            chat_template=_folder_chat_template(folder, config),
            name=str(folder),
        )

    @property
    def bos_token(self) -> str | None:
        return self.inner.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> str | None:
        return self.inner.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def pad_token(self) -> str | None:
        return self.inner.id_to_token(self.pad_token_id) if self.pad_token_id is not None else None

    @property
    def unk_token(self) -> str | None:
        return self.inner.id_to_token(self.unk_token_id) if self.unk_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS are added only if the model asks for them."""
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are ignored."""
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (None for ids outside the vocabulary)."""
        return [self.inner.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def add_special_token(self, text: str) -> int:
        """Make `text` one special token (matched whole in any prompt, never split) and return its id: an id past
        the vocabulary when the vocabulary lacks it."""
        self.inner.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        token_id = self.inner.token_to_id(text)
        self.all_special_ids.add(token_id)
        return token_id

    def apply_chat_template(
        self,
        messages: Sequence[object],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: object,
    ) -> str:
        """Render `messages` to a prompt string with the model's (or the given) chat template.

        Extra keyword arguments (e.g. `documents`, `enable_thinking`) reach the template as variables.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError(f"tokenizer {self.name or '<unnamed>'} has no chat template; pass chat_template")
        documents = kwargs.pop("documents", None)
        special = {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "unk_token": self.unk_token, "pad_token": self.pad_token,
        }
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            special_tokens={k: v for k, v in special.items() if v is not None},
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


def _cache_paths(key: str) -> tuple[Path, Path]:
    d = cache_dir()
    return d / f"{key}.tokenizer.json", d / f"{key}.meta.json"


def _load_cached(key: str) -> tuple[HFTokenizer, GGUFTokenizerInfo] | None:
    tok_path, meta_path = _cache_paths(key)
    if not (tok_path.is_file() and meta_path.is_file()):
        return None
    try:
        info = GGUFTokenizerInfo.from_json(json.loads(meta_path.read_text(encoding="utf-8")))
        return HFTokenizer.from_file(str(tok_path)), info
    except Exception as e:
        logger.warning("ignoring unreadable tokenizer cache %s: %s", tok_path, e)
        return None


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store_cached(key: str, inner: HFTokenizer, info: GGUFTokenizerInfo) -> None:
    tok_path, meta_path = _cache_paths(key)
    try:
        tok_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(tok_path, inner.to_str())
        _atomic_write(meta_path, json.dumps(info.to_json()))
    except OSError as e:
        logger.warning("cannot write tokenizer cache in %s: %s", tok_path.parent, e)


def _add_config_tokens(inner: HFTokenizer, config: JsonObject) -> None:
    """Register added tokens listed only in tokenizer_config.json."""
    for spec in (config.get("added_tokens_decoder") or {}).values():
        content = spec.get("content")
        if content is None or inner.token_to_id(content) is not None:
            continue
        token = AddedToken(
            content, single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", False),
            special=spec.get("special", False),
        )
        if token.special:
            inner.add_special_tokens([token])
        else:
            inner.add_tokens([token])


def _apply_add_special_flags(
    inner: HFTokenizer, config: JsonObject, bos_id: int | None, eos_id: int | None
) -> None:
    """Honour explicit add_bos_token / add_eos_token in tokenizer_config.json."""
    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    if not isinstance(add_bos, bool) and not isinstance(add_eos, bool):
        return
    probe = inner.encode("a", add_special_tokens=True).ids
    has_bos = bool(probe) and probe[0] == bos_id
    has_eos = bool(probe) and probe[-1] == eos_id
    want_bos = add_bos if isinstance(add_bos, bool) else has_bos
    want_eos = add_eos if isinstance(add_eos, bool) else has_eos
    if (want_bos, want_eos) == (has_bos, has_eos):
        return
    single, pair, specials = ["$A:0"], ["$A:0", "$B:1"], []
    if want_bos and bos_id is not None:
        bos = inner.id_to_token(bos_id)
        single, pair = [f"{bos}:0", *single], [f"{bos}:0", "$A:0", f"{bos}:1", "$B:1"]
        specials.append((bos, bos_id))
    if want_eos and eos_id is not None:
        eos = inner.id_to_token(eos_id)
        single, pair = [*single, f"{eos}:0"], [*pair, f"{eos}:1"]
        specials.append((eos, eos_id))
    inner.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
    )


def _folder_chat_template(folder: Path, config: JsonObject) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(folder / "chat_template.json").get("chat_template")
