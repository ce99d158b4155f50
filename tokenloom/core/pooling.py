"""The pooling an embedding engine serves: method, normalization, width and allowed truncations.

A msgspec struct because it crosses two process boundaries typed (worker -> EngineCore in `WorkerInfo`,
EngineCore -> API server in `EngineInfo`); how it is derived from a model folder is
tokenloom/model/pooling_config.py, the math the worker runs is tokenloom/model/pooler.py.
"""
from __future__ import annotations

import msgspec


class PoolingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str  # "mean" | "cls" | "last"
    normalize: bool
    dimensions: int  # the model's hidden size
    matryoshka: tuple[int, ...] | bool = False  # allowed truncations (True: any)

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """None when `dimensions` is allowed, else why not (one line)."""
        if dimensions is None or dimensions == self.dimensions:
            return None
        if not self.matryoshka:
            return f"this model does not support truncated embeddings (dimensions must be {self.dimensions})"
        if not 1 <= dimensions <= self.dimensions:
            return f"dimensions must be between 1 and {self.dimensions}"
        if isinstance(self.matryoshka, tuple) and dimensions not in self.matryoshka:
            return f"dimensions must be one of {', '.join(map(str, self.matryoshka))}"
        return None
