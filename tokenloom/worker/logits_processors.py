"""The sampling rank's logits processors, built once with its runner (tokenloom/model/logits_processor.py)."""
from __future__ import annotations

import torch

from tokenloom.config import EngineConfig
from tokenloom.model.early_stop import RepetitionEarlyStop
from tokenloom.model.logits_processor import LogitsProcessor, load_processor_class


def build_logits_processors(config: EngineConfig, device: torch.device) -> list[LogitsProcessor]:
    """In order: the built-in early stop when `--early-stop-config` enables it, then `--logits-processors`."""
    processors: list[LogitsProcessor] = []
    if config.early_stop_config is not None and config.early_stop_config.enable_early_stop:
        processors.append(RepetitionEarlyStop(config, device))
    for name in config.model.logits_processors or ():
        processors.append(load_processor_class(name)(config, device))
    return processors
