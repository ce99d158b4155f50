"""Prompt + SamplingParams -> a validated EngineCoreRequest (shared by the LLM class and the server)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from PIL import Image

from tokenloom.config import EngineConfig
from tokenloom.core.errors import RequestValidationError
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.multimodal import ImageInput
from tokenloom.core.sampling_params import SamplingParams, SamplingParamsError
from tokenloom.model.logits_processor import load_processor_class
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.processor import ImageProcessor
from tokenloom.structured.backend import get_backend
from tokenloom.structured.spec import normalize_structured_outputs
from tokenloom.tokenizer import Tokenizer

logger = logging.getLogger("tokenloom.engine")


# Texts longer than this are tokenized with `encode_batch`, which releases the GIL (the Rust `encode`
# holds it: a 130,000-character prompt, ~0.12 s here, froze every other thread, the server's event
# loop included, even when called from a worker thread). Shorter ones: `encode`, a few microseconds less.
GIL_FREE_ENCODE_CHARS = 4096


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text)`, without holding the GIL for long texts (same ids)."""
    inner = getattr(tokenizer, "inner", None)
    if len(text) > GIL_FREE_ENCODE_CHARS and hasattr(inner, "encode_batch"):
        return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], model_path: str | None = None):
        """`model_path`: the model's folder, whose processor config says how prompts take images (none for a
        text model)."""
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(dict.fromkeys(list(tokenizer.eos_token_ids) + list(eos_token_ids)))
        # Checked here, on the API side, so a bad argument is a 400 before the request reaches the engine.
        self.logits_processor_classes = [load_processor_class(name) for name in config.model.logits_processors or ()]
        if config.model.mmproj is not None and model_path is not None:
            self.image_processor = ImageProcessor.for_gguf(model_path, config.model.mmproj, config.multimodal,
                                                           tokenizer)
        else:
            self.image_processor = ImageProcessor.for_model(model_path, config.multimodal)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, add_special_tokens=True)
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                arrival_time: float | None = None, cache_salt: str | None = None,
                images: list[Image.Image] = ()) -> EngineCoreRequest:
        """`images`: decoded images for the prompt's image placeholders, in order (a blocking call when there
        are any: preprocessing runs here)."""
        ids = self.tokenize(prompt)
        ids, image_inputs = self.prepare_images(ids, list(images))
        params = self.validate(ids, params)
        self.check_structured(params)
        return EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids, sampling_params=params,
            arrival_time=arrival_time or time.time(), priority=priority,
            bad_words_token_ids=self._bad_words(params.bad_words), eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt, images=image_inputs)

    def check_image_count(self, num_images: int) -> None:
        """Refuse a request's images before any is fetched or decoded: a text model takes none, and a prompt
        at most --limit-mm-per-prompt."""
        if not num_images:
            return
        if self.image_processor is None:
            raise ImageInputError("this model reads no images (a text-only model); send text only")
        self.image_processor.check_count(num_images)

    def prepare_images(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image placeholders expanded, and the engine's ImageInputs."""
        self.check_image_count(len(images))
        if self.image_processor is None or not (images or self.image_processor.placeholder_token_id in ids):
            return ids, []
        ids, inputs = self.image_processor.prepare(ids, images)
        cache = self.config.multimodal.max_encoder_cache
        largest = max((im.length for im in inputs), default=0)
        if cache and largest > cache:
            raise ImageInputError(f"an image takes {largest} encoder rows; the encoder cache holds "
                                  f"{cache} (--max-encoder-cache)")
        return ids, inputs

    def validate(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check a tokenized prompt against the context and limits; returns params with max_tokens clamped."""
        n = len(ids)
        if n == 0:
            raise RequestValidationError("the prompt is empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestValidationError(f"prompt token id {bad[0]} is outside the vocabulary "
                                         f"(0..{self.vocab_size - 1})", "prompt")
        limits = self.config.limits
        try:
            params.validate_limits(max_n=limits.max_n, max_logprobs=limits.max_logprobs,
                                   max_stop=limits.max_stop_sequences, max_stop_len=limits.max_stop_length,
                                   max_logit_bias=limits.max_logit_bias, vocab_size=self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestValidationError(str(exc), getattr(exc, "field", None)) from None
        for processor in self.logits_processor_classes:
            try:
                processor.validate_params(params)
            except ValueError as exc:
                raise RequestValidationError(f"{processor.__name__}: {exc}", "vllm_xargs") from None
        if params.logprobs_mode is None:
            params = replace(params, logprobs_mode=self.config.model.logprobs_mode)
        if len(params.bad_words or ()) > limits.max_bad_words:
            raise RequestValidationError(f"bad_words has {len(params.bad_words)} entries; the limit is "
                                         f"{limits.max_bad_words}", "bad_words")
        ctx = self.max_model_len
        if params.embed:  # one whole prefill: within the context and one step's token budget
            limit = min(ctx, self.config.scheduler.max_num_batched_tokens)
            if n > limit:
                raise RequestValidationError(f"the input has {n} tokens; this model embeds at most {limit} "
                                             f"tokens per input", "prompt", "context_length_exceeded")
            return params
        if n >= ctx:
            raise RequestValidationError(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has {n} tokens, "
                f"leaving no room for output.", "prompt", "context_length_exceeded")
        if n + params.min_tokens >= ctx + 1:
            raise RequestValidationError(
                f"prompt ({n} tokens) + min_tokens ({params.min_tokens}) exceeds the maximum context length "
                f"of {ctx} tokens", "min_tokens", "context_length_exceeded")
        room = ctx - n
        if params.max_tokens is None or params.max_tokens > room:
            if params.max_tokens is not None:
                logger.info("max_tokens %d clamped to %d: the prompt has %d of %d context tokens",
                            params.max_tokens, room, n, ctx)
            params = replace(params, max_tokens=room)
        return params

    def check_structured(self, params: SamplingParams, param: str = "structured_outputs") -> None:
        """Validate and compile (cached) the request's constraint here, so a bad one fails before queueing."""
        if not params.structured_outputs:
            return
        spec = normalize_structured_outputs(params.structured_outputs, param)
        if spec is not None:
            get_backend(self.tokenizer, self.vocab_size).compile(spec, param)

    def _bad_words(self, words: list[str] | None) -> list[list[int]]:
        out = []
        for word in words or ():
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
