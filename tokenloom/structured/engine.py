"""The EngineCore's entry to structured outputs: builds each request's `StructuredState`.

The tokenizer and the xgrammar backend load on a background thread the first time a request
needs them; compiles run on the backend's pool. A new request therefore never blocks the step
loop: its state waits for the grammar only when it samples its first token (after its prefill).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.structured.backend import XgrammarBackend, get_backend
from tokenloom.structured.matcher import StructuredState
from tokenloom.structured.reasoning import get_reasoning_parser
from tokenloom.structured.spec import normalize_structured_outputs
from tokenloom.structured.thinking import ThinkingTracker


class StructuredEngine:
    def __init__(self, model_path: str, vocab_size: int, reasoning_parser: str | None = None) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.reasoning_parser = reasoning_parser
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-setup")
        self._backend: Future | None = None

    def _load_backend(self) -> XgrammarBackend:
        """On the first structured request: the engine process imports tokenizers and jinja2 only then."""
        from tokenloom.tokenizer import Tokenizer  # lazy: tokenizers + jinja2 load on the first structured request
        return get_backend(Tokenizer.from_model_path(self.model_path), self.vocab_size)

    def backend(self) -> Future:
        if self._backend is None:
            self._backend = self._pool.submit(self._load_backend)
        return self._backend

    def new_state(self, prompt_ids: list[int], params: SamplingParams,
                  eos_token_ids: list[int]) -> StructuredState | None:
        """None when the request has no constraint and no thinking budget to enforce."""
        spec = normalize_structured_outputs(params.structured_outputs)
        budget = getattr(params, "thinking_token_budget", None)
        markers = None
        if self.reasoning_parser:
            parser = get_reasoning_parser(self.reasoning_parser)
            markers = (parser.start, parser.end)
        track = markers is not None and (spec is not None or budget is not None)
        if spec is None and not track:
            return None
        backend = self.backend()

        def ready():
            b = backend.result()
            compiled = b.compile(spec) if spec is not None else None

            def make_tracker():
                return ThinkingTracker(b.tokenizer, markers[0], markers[1], prompt_ids, budget)

            return compiled, (make_tracker if track else None), b.tokenizer

        return StructuredState(self._pool.submit(ready), eos_token_ids)
