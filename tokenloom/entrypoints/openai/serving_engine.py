"""What /v1/chat/completions, /v1/completions and /v1/embeddings share before a request reaches the engine.

`OpenAIServing` checks a request (server draining, engine down, model name, limits), admits it
(request_admission.py), gives it an id and a timeout, maps its fields to SamplingParams (sampling.py) and
tokenizes and validates its prompt, turning input errors into 400s that name the field. The response side
is formatting.py (ids, usage, logprobs) and streaming.py (SSE, disconnects); errors.py maps engine errors.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from PIL import Image

from tokenloom.core.errors import RequestValidationError
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams, SamplingParamsError
from tokenloom.engine.admission import Reservation
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.admission import Arrival
from tokenloom.entrypoints.openai.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from tokenloom.entrypoints.openai.formatting import random_id
from tokenloom.entrypoints.openai.kv_trust import check_kv_transfer_params
from tokenloom.entrypoints.openai.limits import check_request_limits, check_text
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenloom.entrypoints.openai.request_admission import admit_arrival, current_reservation, estimate_arrival
from tokenloom.entrypoints.openai.sampling import to_sampling_params
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.tokenizer import Tokenizer

logger = logging.getLogger("tokenloom.server")


class OpenAIServing:
    """Base of the chat, completion and embedding handlers."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], state: ServerState | None = None,
                 system_fingerprint: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.state = state or ServerState()
        self.system_fingerprint = system_fingerprint or "tokenloom"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name for a request that names a LoRA adapter (as vLLM
        answers, so a client can tell which fine-tune spoke), else the first served name."""
        lora = self.lora_for(model)
        return lora.lora_name if lora is not None else self.model_name

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.engine.tokenizer is not None, "the engine is not started"
        return self.engine.tokenizer

    # ------------------------------------------------------------------ checks

    def check_request(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        self.check_available()
        self.check_model(request.model)
        if self.engine.pooling is not None:
            raise BadRequestError("this model embeds: it answers /v1/embeddings, not text generation (serve a "
                                  "generative model for completions and chat)", param="model",
                                  code="model_not_generative")
        check_text(request)
        check_request_limits(request, self.engine.max_model_len)
        self.admit(request)

    def check_available(self) -> None:
        """503 while the server drains or the engine is down or restarting."""
        if self.state.draining:
            raise ServiceUnavailableError("the server is shutting down", code="shutting_down")
        if self.engine.weight_updates.sleep_level:
            raise ServiceUnavailableError("the engine is asleep; wake it with /wake_up", code="engine_asleep",
                                          headers={"Retry-After": "10"})
        if not self.engine.is_healthy:
            self._rejected("engine_unavailable")
            if self.engine.restarting:
                raise ServiceUnavailableError("the engine is restarting after a failure; retry shortly",
                                              code="engine_restarting", headers={"Retry-After": "5"})
            raise ServiceUnavailableError(f"the engine is not running: {self.engine.dead_reason}",
                                          code="engine_dead", headers={"Retry-After": "10"})

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is one of the served names or a LoRA adapter's."""
        if model is not None and model not in self.served_model_names and self.lora_for(model) is None:
            adapters = list(self.state.lora_models.adapters) if self.state.lora_models is not None else []
            raise NotFoundError(f"The model `{model}` does not exist. Available: "
                                f"{', '.join(self.served_model_names + adapters)}", param="model",
                                code="model_not_found")

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model field names, or None (the base model)."""
        return self.state.lora_models.resolve(model) if self.state.lora_models is not None else None

    def _rejected(self, reason: str) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.observe_rejected(reason)

    # ------------------------------------------------------------------ admission

    def admit(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        """Admission, answered at once: 503 + Retry-After when the request's expected time to complete (its wait
        plus its own decode in the batch it joins) is over --max-expected-latency or its own timeout, its wait
        over --max-queue-wait, or too many sequences already wait (see `admission.decide`)."""
        width = max(request.n or 1, getattr(request, "best_of", None) or 1)
        max_n = self.engine.config.limits.max_n
        if max_n is not None and width > max_n:
            return  # fails validation next, with a 400 naming n / best_of
        prompts: list[str | list[int] | None] = list(request.prompts()) if isinstance(request, CompletionRequest) \
            else [None]
        self.admit_arrival(estimate_arrival(request, width, prompts, self.engine.max_model_len))

    def admit_arrival(self, arrival: Arrival) -> None:
        """503 + Retry-After now if `arrival` is refused; else reserve its work until the engine takes it over."""
        admit_arrival(self.engine, self.state, arrival, self._rejected)

    def reservation(self) -> Reservation | None:
        """This HTTP request's admission reservation (None outside the server's middleware)."""
        return current_reservation()

    # ------------------------------------------------------------------ the request for the engine

    def timeout_for(self, request: SamplingFields) -> float | None:
        """The request's `timeout` field, capped by the server's --request-timeout."""
        values = [t for t in (request.timeout, self.state.request_timeout) if t]
        return min(values) if values else None

    def request_id(self, request: SamplingFields, prefix: str, num_prompts: int = 1) -> str:
        """The client's request_id (400 if it, or one of its per-prompt ids `ID-i`, is in use) or a new one."""
        rid = request.request_id
        if rid:
            taken = [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]
            if self.engine.has_request(rid) or any(self.engine.has_request(r) for r in taken):
                raise BadRequestError(f"request_id {rid!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
            return rid
        return random_id(prefix)

    def sampling_params(self, request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        default_max_tokens: int | None, best_of: int | None = None,
                        echo_logprobs: bool = False) -> SamplingParams:
        check_kv_transfer_params(request.kv_transfer_params, self.engine.config.kv_transfer_config)
        return to_sampling_params(request, self.engine.default_sampling_params(), max_tokens=max_tokens,
                                  logprobs=logprobs, default_max_tokens=default_max_tokens, best_of=best_of,
                                  echo_logprobs=echo_logprobs)

    def process_inputs(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int, cache_salt: str | None, prompt_param: str = "prompt",
                       data_parallel_rank: int | None = None, model: str | None = None,
                       images: Sequence[Image.Image] = ()) -> EngineCoreRequest:
        """Tokenize and validate one prompt; input errors become 400 naming the field. `model`: the request's
        model field, which may name a LoRA adapter."""
        try:
            req = self.engine.process_inputs(request_id, prompt, params, priority=priority,
                                             arrival_time=time.time(), cache_salt=cache_salt,
                                             data_parallel_rank=data_parallel_rank, images=images)
            req.lora_request = self.lora_for(model)
            return req
        except RequestValidationError as e:
            param = e.param
            cause = e.__cause__ or e.__context__
            if param is None and isinstance(cause, SamplingParamsError):
                param = cause.field
            if param == "prompt":
                param = prompt_param
            raise BadRequestError(e.message, param=param, code=e.code or "invalid_value") from None
        except SamplingParamsError as e:
            raise BadRequestError(str(e), param=e.field, code="invalid_value") from None
