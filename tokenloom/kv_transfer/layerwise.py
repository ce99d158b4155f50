"""The KV caches as the model walks them, with a connector's per-layer hooks between the layers.

Models take their caches as an iterable and run ``for layer, kv_cache in zip(self.layers, kv_caches)``, so
handing them this object instead of the list puts the hooks exactly between layers without touching any
model or attention backend: before layer i receives its cache, layer i-1 has written its KV
(`save_kv_layer(i - 1)`) and layer i's loads are waited for (`wait_for_layer_load(i)`). The runner passes
it only on a step whose connector has layer work, so any other step (every step of an engine without a
connector) runs the plain list: no cost.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenloom.core.kv_connector import WorkerConnector


class LayerwiseCaches:
    def __init__(self, caches: list[torch.Tensor], connector: WorkerConnector):
        self.caches = caches
        self.connector = connector
        self.entered = 0  # layers handed to the model (their loads waited for)
        self.saved = 0  # layers reported written

    def __len__(self) -> int:
        return len(self.caches)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.caches[layer]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for layer, cache in enumerate(self.caches):
            self._finish_up_to(layer)
            self.connector.wait_for_layer_load(layer)
            self.entered = layer + 1
            yield cache

    def _finish_up_to(self, layer: int) -> None:
        while self.saved < min(layer, self.entered):
            self.connector.save_kv_layer(self.saved)
            self.saved += 1

    def finish(self) -> None:
        """After the forward: the last layer's save (the model's zip stops before asking for more), and every
        hook for layers a failed forward never reached, so the connector always sees each layer once."""
        for layer in range(self.entered, len(self.caches)):
            self.connector.wait_for_layer_load(layer)
            self.entered = layer + 1
        self._finish_up_to(len(self.caches))
