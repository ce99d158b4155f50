"""Typed messages between the frontend (LLM class or API server) and the EngineCore.

They are msgspec structs so they cross a ZMQ socket as msgpack, never pickle.
The EngineCore only schedules and computes: it sees token ids, never text.
"""
from __future__ import annotations

import msgspec

from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.multimodal import ImageInput
from tokenloom.core.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Token-id sequences derived from SamplingParams.bad_words by the frontend's tokenizer.
    bad_words_token_ids: list[list[int]] = []
    eos_token_ids: list[int] = []
    cache_salt: str | None = None
    # Data parallel: the engine replica that must run it (None: the frontend chooses; dp_client.py).
    data_parallel_rank: int | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    images: list[ImageInput] = []  # its images, in prompt order, placeholders already expanded


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one engine step produced for one (child) sequence."""

    request_id: str
    index: int = 0  # which of the request's n (or best_of) sequences
    new_token_ids: list[int]
    # Per new token: [[token_id, logprob, rank], ...], chosen token first, then top-k.
    new_logprobs: list[list[list[float]]] | None = None
    # For the whole prompt (first position None), sent once with the first token.
    prompt_logprobs: list[list[list[float]] | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    embedding: list[float] | None = None  # an embedding request's result (it finishes in the same output)
    kv_transfer_params: dict | None = None  # a finished remote-decode prefill: what its decoder needs
    # Timestamps (time.time()) for metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
