"""Per-request sampling parameters (vLLM names and semantics).

`SamplingParams` is a plain dataclass so that msgspec can send it over ZMQ as msgpack
(`msgspec.msgpack.encode(p)` / `decode(b, type=SamplingParams)`); msgspec calls
`__post_init__` on decode, so a decoded object is validated and normalized like a
constructed one (a failure surfaces as `msgspec.ValidationError` there).

Validation that does not depend on the engine configuration happens in `__post_init__`
and raises `SamplingParamsError` (a `ValueError`) whose message names the field, the
value and the allowed range, and whose `.field` attribute holds the field name.
Limits set by the engine config (max n, max logprobs, ...) and the vocabulary size are
checked by `validate_limits`, which the frontend calls once it knows them.
"""
from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

# Temperatures below this are treated as greedy (as vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5

# What a request's logprobs report (vLLM's --logprobs-mode names): the model's distribution as it came out
# ("raw": before logit bias, penalties, temperature and top-k/p/min-p) or the one a token was drawn from
# ("processed"), as log-probabilities or as the logits themselves. A trainer that recomputes the policy's
# probabilities needs "processed_logprobs"; "raw" and "processed" are accepted for the logprobs forms.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
_LOGPROBS_MODE_ALIASES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}

# Defaults for the engine-config limits checked by `validate_limits`.
DEFAULT_MAX_N = 128
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_STOP = 64
DEFAULT_MAX_STOP_LEN = 1024
DEFAULT_MAX_LOGIT_BIAS = 4096

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


class SamplingParamsError(ValueError):
    """Invalid sampling parameter; `field` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _err(name: str, value: object, allowed: str) -> SamplingParamsError:
    return SamplingParamsError(name, f"{name} must be {allowed}, got {value!r}")


_INT64 = (-2 ** 63, 2 ** 63 - 1)


def _is_int(v: object) -> bool:
    """A plain int that fits in 64 bits (what msgpack, torch and the engine carry)."""
    return isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]


def _is_real(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_int(name: str, v: object, lo: int | None, hi: int | None, allowed: str) -> int:
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _err(name, v, allowed)
    return v


def _check_float(name: str, v: object, lo: float, hi: float, allowed: str,
                 lo_open: bool = False, hi_open: bool = False) -> float:
    if not _is_real(v):
        raise _err(name, v, allowed)
    v = float(v)
    if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        raise _err(name, v, allowed)
    return v


def _check_bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise _err(name, v, "a bool")
    return v


def _check_token_ids(name: str, v: object, *, allow_empty: bool = True) -> list[int]:
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
        raise _err(name, v, "a list of token ids (ints >= 0)")
    out = list(v)
    for t in out:
        if not _is_int(t) or t < 0:
            raise _err(name, v, "a list of token ids (ints >= 0)")
    if not allow_empty and not out:
        raise _err(name, v, "a non-empty list of token ids (ints >= 0)")
    return out


def _check_strings(name: str, v: object) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if isinstance(v, (bytes, dict)) or not hasattr(v, "__iter__"):
        raise _err(name, v, "a string or a list of non-empty strings")
    out = list(v)
    for s in out:
        if not isinstance(s, str) or not s:
            raise _err(name, v, "a string or a list of non-empty strings")
    return out


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: dict | None = None
    # None: the engine's --logprobs-mode (raw_logprobs unless set).
    logprobs_mode: str | None = None
    # With a reasoning parser: end the reasoning after this many tokens by forcing its end marker.
    thinking_token_budget: int | None = None
    # An embedding request (LLM.embed, /v1/embeddings): the engine computes the whole prompt in one step and
    # answers its pooled hidden state; nothing is sampled.
    embed: bool = False
    # Prefill/decode disaggregation (vLLM's name): {"do_remote_decode": true} on a prefill instance, or the
    # params it returned on a decode instance (tokenloom.kv_transfer.pd_scheduler checks them).
    kv_transfer_params: dict | None = None
    # The request's own arguments for the engine's logits processors (vLLM's extra_args; `vllm_xargs` in an
    # HTTP body): a flat JSON object.
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, 1, None, "an int >= 1")
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of, self.n, None,
                                      f"None or an int >= n ({self.n})")
        self.temperature = _check_float("temperature", self.temperature, 0.0, math.inf,
                                        "a finite float >= 0 (0 = greedy)")
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, "a float in (0, 1]",
                                  lo_open=True)
        if not _is_int(self.top_k) or not (self.top_k >= 1 or self.top_k in (0, -1)):
            raise _err("top_k", self.top_k, "0 or -1 (disabled) or an int >= 1")
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0, "a float in [0, 1]")
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty,
                                             -2.0, 2.0, "a float in [-2, 2]")
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty,
                                              -2.0, 2.0, "a float in [-2, 2]")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty,
                                               0.0, math.inf, "a finite float > 0",
                                               lo_open=True)
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, _INT64_MIN, _UINT64_MAX,
                                   "None or an int in [-2**63, 2**64 - 1]")
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, 1, None,
                                         "None or an int >= 1")
        hi = self.max_tokens
        self.min_tokens = _check_int(
            "min_tokens", self.min_tokens, 0, hi,
            "an int >= 0" + (f" and <= max_tokens ({hi})" if hi is not None else ""))
        self.stop = [] if self.stop is None else _check_strings("stop", self.stop)
        self.stop_token_ids = ([] if self.stop_token_ids is None
                               else _check_token_ids("stop_token_ids", self.stop_token_ids))
        self.bad_words = ([] if self.bad_words is None
                          else _check_strings("bad_words", self.bad_words))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids(
                "allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "embed"):
            _check_bool(name, getattr(self, name))
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, None,
                                       "None or an int >= 0")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, 0,
                                              None, "None or an int >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, dict):
            raise _err("structured_outputs", self.structured_outputs, "None or a dict")
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _check_int("thinking_token_budget", self.thinking_token_budget, 0,
                                                    None, "None or an int >= 0")
        if self.kv_transfer_params is not None and not (isinstance(self.kv_transfer_params, dict)
                                                        and len(self.kv_transfer_params) <= 16):
            raise _err("kv_transfer_params", self.kv_transfer_params, "None or a dict of at most 16 keys")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and len(self.extra_args) <= 64
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise _err("extra_args", self.extra_args, "None or a dict of at most 64 string keys")
        if self.logprobs_mode is not None:
            if isinstance(self.logprobs_mode, str):
                self.logprobs_mode = _LOGPROBS_MODE_ALIASES.get(self.logprobs_mode, self.logprobs_mode)
            if self.logprobs_mode not in LOGPROBS_MODES:
                raise _err("logprobs_mode", self.logprobs_mode, "None or one of " + ", ".join(LOGPROBS_MODES))

    @staticmethod
    def _normalize_logit_bias(bias: object) -> dict[int, float]:
        allowed = "a dict {token id (int >= 0): bias (float in [-100, 100])}"
        if not isinstance(bias, dict):
            raise _err("logit_bias", bias, allowed)
        out: dict[int, float] = {}
        for k, v in bias.items():
            # JSON object keys are strings: accept "123" as token id 123.
            if isinstance(k, str) and k.isascii() and k.isdigit():
                k = int(k)
            if not _is_int(k) or k < 0 or not _is_real(v) or not -100.0 <= v <= 100.0:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias must be {allowed}, got entry {k!r}: {v!r}")
            out[k] = float(v)
        return out

    # ------------------------------------------------------------------ limits

    def validate_limits(
        self,
        *,
        max_n: int | None = DEFAULT_MAX_N,
        max_logprobs: int | None = DEFAULT_MAX_LOGPROBS,
        max_stop: int | None = DEFAULT_MAX_STOP,
        max_stop_len: int | None = DEFAULT_MAX_STOP_LEN,
        max_logit_bias: int | None = DEFAULT_MAX_LOGIT_BIAS,
        vocab_size: int | None = None,
    ) -> None:
        """Check the limits the engine config sets; None (or -1 for max_logprobs) = no limit.

        Token ids in logit_bias / allowed_token_ids / stop_token_ids must be < vocab_size
        when vocab_size is given.
        """
        if max_n is not None:
            if self.n > max_n:
                raise _err("n", self.n, f"<= {max_n}")
            if self.best_of is not None and self.best_of > max_n:
                raise _err("best_of", self.best_of, f"<= {max_n}")
        if max_logprobs is not None and max_logprobs >= 0:
            for name in ("logprobs", "prompt_logprobs"):
                v = getattr(self, name)
                if v is not None and v > max_logprobs:
                    raise _err(name, v, f"None or an int in [0, {max_logprobs}]")
        if max_stop is not None and len(self.stop) > max_stop:
            raise SamplingParamsError(
                "stop", f"stop must have at most {max_stop} sequences, got {len(self.stop)}")
        if max_stop_len is not None:
            for s in self.stop:
                if len(s) > max_stop_len:
                    raise SamplingParamsError(
                        "stop", f"stop sequences must be at most {max_stop_len} characters, "
                        f"got one of {len(s)}: {s[:50]!r}...")
        if (max_logit_bias is not None and self.logit_bias is not None
                and len(self.logit_bias) > max_logit_bias):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must have at most {max_logit_bias} entries, "
                f"got {len(self.logit_bias)}")
        if vocab_size is not None:
            checks = (("logit_bias", list(self.logit_bias or ())),
                      ("allowed_token_ids", self.allowed_token_ids or []),
                      ("stop_token_ids", self.stop_token_ids))
            for name, ids in checks:
                bad = [t for t in ids if t >= vocab_size]
                if bad:
                    raise SamplingParamsError(
                        name, f"{name} token ids must be in [0, {vocab_size}) "
                        f"(vocab_size), got {bad[0]}")
            for name in ("logprobs", "prompt_logprobs"):
                v = getattr(self, name)
                if v is not None and v > vocab_size:
                    raise _err(name, v, f"<= vocab_size ({vocab_size})")

    # ----------------------------------------------------------------- helpers

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax: temperature 0 (below SAMPLING_EPS) or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def effective_best_of(self) -> int:
        return self.n if self.best_of is None else self.best_of

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
