"""An OpenAI request's sampling fields -> SamplingParams, with the server-side defaults (the model's
generation_config.json, or --override-generation-config) under the client's values; bad values -> 400."""
from __future__ import annotations

from tokenloom.core.sampling_params import SamplingParams, SamplingParamsError
from tokenloom.engine.generation_defaults import GenerationDefaults
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.protocol import SamplingFields


def to_sampling_params(request: SamplingFields, defaults: GenerationDefaults, *, max_tokens: int | None,
                   logprobs: int | None, default_max_tokens: int | None, best_of: int | None = None,
                   echo_logprobs: bool = False) -> SamplingParams:
    def pick(name: str, fallback: float | int) -> float | int:
        value = getattr(request, name)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    if max_tokens is None:
        max_tokens = defaults.get("max_tokens", default_max_tokens)  # type: ignore[assignment]
    prompt_logprobs = request.prompt_logprobs
    if echo_logprobs and prompt_logprobs is None:
        prompt_logprobs = logprobs
    try:
        return SamplingParams(
            n=request.n if request.n is not None else 1,
            best_of=best_of,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=dict(request.logit_bias) if request.logit_bias else None,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=([request.stop] if isinstance(request.stop, str) else list(request.stop or [])),
            stop_token_ids=list(request.stop_token_ids or []),
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            bad_words=list(request.bad_words or []),
            allowed_token_ids=request.allowed_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            kv_transfer_params=request.kv_transfer_params,
            extra_args=request.vllm_xargs,
        )
    except SamplingParamsError as e:
        raise BadRequestError(str(e), param=getattr(e, "field", None), code="invalid_value") from None
    except (ValueError, TypeError) as e:
        raise BadRequestError(str(e), code="invalid_value") from None
