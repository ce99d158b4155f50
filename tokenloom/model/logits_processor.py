"""Batch-level logits processors: user code that rewrites a step's logits before anything is drawn.

`--logits-processors module:Class` (vLLM's flag; `module.Class` works too) names subclasses of
`LogitsProcessor`. Each is built once per worker that samples and, every step, sees the logits of the rows
that draw ([rows, vocab] float32) with the rows themselves: the request id, its `SamplingParams` (whose
`extra_args` carry the request's own arguments: `vllm_xargs` in an HTTP body, `SamplingParams(extra_args=...)`
offline), its prompt and the tokens it has generated. They run first in the sampler, after the raw logits
are kept for `raw_*` logprobs and before logit bias, penalties, temperature and top-k/p, so a processed
logprobs mode reports what they did.

The sampler keeps no per-row state between steps, and neither does this interface: a processor that needs
memory (the early stop below) keys it by request id. A processor that raises fails the step; the engine then
re-runs the batch in halves to find the request that makes it raise and ends that request alone
(tokenloom/engine/faults.py), so one bad argument never costs the other requests their output.
`validate_params` runs on the API side when a request arrives: a bad argument is a 400 there, before the
request reaches the engine.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API process checks requests against these classes without loading torch
    import torch

    from tokenloom.model.sampling_row import SamplingRow


class LogitsProcessor(ABC):
    """One processor instance per sampling worker; `apply` returns the batch's new logits (in place is fine)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError (its message becomes the 400's) when a request's `extra_args` are not usable."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits of `rows` ([len(rows), vocab] float32) after this processor."""


def load_processor_class(name: str) -> type[LogitsProcessor]:
    """`module:Class` or `module.Class` -> the class, with a one-line error naming what is wrong."""
    module_name, sep, class_name = name.partition(":")
    if not sep:
        module_name, _, class_name = name.rpartition(".")
    if not module_name or not class_name:
        raise ConfigError(f"logits processor {name!r}: expected module:Class or module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"logits processor {name!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ConfigError(f"logits processor {name!r}: {module_name}.{class_name} is not a subclass of "
                          f"tokenloom.LogitsProcessor")
    return cls

