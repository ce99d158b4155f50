"""Prefill attention metadata for a step whose image tokens attend to each other both ways (Gemma 3's images,
`ImageInput.attend_whole`): each prefill chunk is marked with the position ranges of the images it reaches,
and the torch attention adds them to its causal mask (`PrefillChunk.bidirectional`).

The native prefill kernel is causal only, so such a step takes the torch backend's metadata over the same KV
caches (the native backend's layout is the torch one, and its layers run the torch reference when handed
the torch metadata). Every other step keeps its backend's metadata and kernels.
"""
from __future__ import annotations

import torch

from tokenloom.model.layers.attention import AttentionMetadata
from tokenloom.model.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from tokenloom.worker.batch_layout import BatchLayout
from tokenloom.worker.encoder_cache import ImageRows


class ImageSpanAttention:
    def __init__(self, attention: AttentionBackend, kv_caches: list[torch.Tensor]):
        self.backend: AttentionBackend | None = None
        if isinstance(attention, TorchAttentionBackend):
            self.backend = attention
        elif attention.name == "native" and kv_caches:
            self.backend = TorchAttentionBackend()
            self.backend.bind(kv_caches[0])
        self.name = attention.name

    def metadata(self, batch: BatchLayout, images: list[ImageRows], device: torch.device) -> AttentionMetadata:
        if self.backend is None:
            raise ValueError(f"the {self.name} attention backend cannot attend an image's tokens both ways; "
                             f"serve this model with --attention-backend torch")
        meta = batch.metadata(self.backend, device)
        for chunk in meta.prefills:
            chunk.bidirectional = [im.bidirectional for im in images
                                   if im.bidirectional is not None and chunk.start <= im.first_row < chunk.end]
        return meta


def needs_image_spans(images: list[ImageRows]) -> bool:
    return any(im.bidirectional is not None for im in images)
