"""xgrammar backend: one `TokenizerInfo` per tokenizer, and compiled grammars cached by spec key.

Compilation runs on a small thread pool, so the engine can start a compile when a request
arrives and only wait for it (if at all) when the request samples its first token. Errors
come back as `StructuredOutputError` with xgrammar's message, minus its source location.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from tokenloom.structured.errors import StructuredOutputError
from tokenloom.structured.spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr

    from tokenloom.tokenizer.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 30.0
MAX_GRAMMAR_BYTES = 256 * 2 ** 20
CACHE_ENTRIES = 256
# Whitespace characters the JSON grammar allows between two elements (stops a weak model
# from emitting newlines forever while still allowing indented output).
MAX_JSON_WHITESPACE = 24

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar", "structural_tag": "structural tag"}
_NOISE = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: |Check failed: \(.*?\) is false: ", re.M)


def _clean(message: str) -> str:
    return _NOISE.sub("", str(message)).strip().splitlines()[0] if str(message).strip() else "unknown error"


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar TokenizerInfo from our Tokenizer (`.inner` is a tokenizers.Tokenizer); `vocab_size` is the
    model's (its LM head may be wider than the tokenizer: the extra ids are never allowed)."""
    import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only
    vocab = tokenizer.inner.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.inner.to_str())
    vocab_type, prefix = meta["vocab_type"], meta["add_prefix_space"]
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type, prefix = from_vocab, False
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids) or None, add_prefix_space=prefix)


class XgrammarBackend:
    """Compiles `GrammarSpec`s for one tokenizer; thread-safe; LRU cache of compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None, *,
                 compile_timeout: float = COMPILE_TIMEOUT_S, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 cache_entries: int = CACHE_ENTRIES, max_threads: int = 2) -> None:
        import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(dict.fromkeys(stop_token_ids or tokenizer.eos_token_ids))
        self.info = tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self.compile_timeout = compile_timeout
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_entries = cache_entries
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")

    def compile_async(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (shared by every caller with the same key)."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, key=spec.key: self._forget_failed(key, f))
        return fut

    def compile(self, spec: GrammarSpec, param: str | None = None):
        """Compile now (or take it from the cache); raises StructuredOutputError naming `param`."""
        fut = self.compile_async(spec)
        try:
            return fut.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise StructuredOutputError(f"compiling the {_WHAT[spec.kind]} took longer than "
                                        f"{self.compile_timeout:g} s; simplify it", param) from None
        except StructuredOutputError as e:
            if param is not None and e.param != param:
                raise StructuredOutputError(e.message, param) from None
            raise

    def _forget_failed(self, key: tuple, fut: Future) -> None:
        if fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def _compile(self, spec: GrammarSpec):
        c = self.compiler
        try:
            if spec.kind == "json":
                grammar = c.compile_json_schema(spec.spec, any_whitespace=spec.any_whitespace,
                                                strict_mode=spec.strict,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
            elif spec.kind == "json_object":
                grammar = c.compile_json_schema('{"type":"object"}', any_whitespace=spec.any_whitespace,
                                                strict_mode=False,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
            elif spec.kind == "regex":
                grammar = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                choices = json.loads(spec.spec)
                ebnf = "root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in choices)
                grammar = c.compile_grammar(ebnf)
            elif spec.kind == "grammar":
                grammar = c.compile_grammar(spec.spec)
            elif spec.kind == "structural_tag":
                grammar = c.compile_structural_tag(spec.spec)
            else:  # pragma: no cover - GrammarSpec kinds are fixed
                raise StructuredOutputError(f"unknown constraint kind {spec.kind!r}")
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / pydantic errors
            raise StructuredOutputError(f"invalid {_WHAT[spec.kind]}: {_clean(e)}") from None
        size = grammar.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise StructuredOutputError(f"the compiled {_WHAT[spec.kind]} is too large ({size >> 20} MiB; the "
                                        f"limit is {self.max_grammar_bytes >> 20} MiB)")
        self._check_can_start(grammar, spec)
        return grammar

    def _check_can_start(self, grammar: xgr.CompiledGrammar, spec: GrammarSpec) -> None:
        """Refuse a grammar that allows no first token (`root ::= root`, an empty regex class): it could
        never produce output, and would otherwise end every request with an engine error."""
        import torch  # lazy: only this check needs torch; the module loads without it
        import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only

        matcher = xgr.GrammarMatcher(grammar)
        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask)
        if not bool(mask.any()):
            raise StructuredOutputError(f"the {_WHAT[spec.kind]} matches no output at all (no first token is "
                                        f"allowed, e.g. a rule that only refers to itself)")


_BACKENDS: dict[tuple, XgrammarBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def get_backend(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> XgrammarBackend:
    """The process's backend for this tokenizer (by name) and model vocab size; built on first use, so the
    offline LLM's frontend and engine share one compile cache."""
    key = (getattr(tokenizer, "name", "") or id(tokenizer), vocab_size, tuple(stop_token_ids or ()))
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            backend = _BACKENDS[key] = XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
        return backend
