"""FastDeploy's repetition early stop as a built-in logits processor (`--early-stop-config`).

A model stuck in a loop keeps predicting its next token with near certainty; serving it to max_tokens burns
the batch's time for text nobody wants. When a row's most likely token has had probability above the
threshold for `window_size` sampled positions in a row, the row's logits are replaced by its end-of-sequence
token alone, so the sequence ends with finish_reason "stop" like any other. Rows with `ignore_eos` or without
an end-of-sequence token are left alone. The streak is kept per request id and forgotten when a request is
not in a step's batch (finished, or preempted: it then starts a new window).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.config import EarlyStopConfig, EngineConfig
from tokenloom.model.logits_processor import LogitsProcessor
from tokenloom.model.sampling_row import SamplingRow


class RepetitionEarlyStop(LogitsProcessor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        settings = config.early_stop_config or EarlyStopConfig(enable_early_stop=True)
        self.window = settings.window_size
        self.threshold = settings.threshold
        self.streaks: dict[str, int] = {}

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        top_prob = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()
        streaks: dict[str, int] = {}
        for i, (row, prob) in enumerate(zip(rows, top_prob)):
            before = streaks.get(row.request_id, self.streaks.get(row.request_id, 0))
            streak = before + 1 if prob > self.threshold else 0
            streaks[row.request_id] = streak
            if streak >= self.window and row.eos_token_ids and not row.params.ignore_eos:
                eos = row.eos_token_ids[0]
                logits[i].fill_(float("-inf"))
                logits[i, eos] = 0.0
        self.streaks = streaks
        return logits
