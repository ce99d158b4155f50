"""The worker's encoder cache: each image's encoder rows by content hash, computed the first time a step's
tokens reach the image's placeholders and dropped when the scheduler says nobody will read them again
(`SchedulerOutput.encoder_cache_frees`; the scheduler's account is tokenloom/scheduler/encoder_cache.py).

`step_image_rows` is what a step's forward needs: for every placeholder row in the flat batch, the encoder
row that replaces its token embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.core.multimodal import ImageInput
from tokenloom.worker.batch_layout import BatchLayout
from tokenloom.worker.request_state import RequestState


@dataclass
class ImageRows:
    """Encoder rows to write over a step's token embeddings: flat rows `first_row ..` take `rows`."""

    first_row: int
    rows: torch.Tensor
    # The image's placeholder positions [offset, end) in its sequence when they attend to each other both
    # ways in prefill (ImageInput.attend_whole); None: causal.
    bidirectional: tuple[int, int] | None = None


class EncoderCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.rows: dict[str, torch.Tensor] = {}

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            self.rows.pop(h, None)

    def clear(self) -> None:
        """After a weight update: the tower's weights changed, so every row is stale."""
        self.rows.clear()

    def step_image_rows(self, model: torch.nn.Module, batch: BatchLayout,
                        scheduled: list[tuple[RequestState, int]]) -> list[ImageRows]:
        """The encoder rows this step's placeholder tokens take, encoding the images not yet cached (in one
        call of the model's `encode_images`, which batches them as its tower can)."""
        spans = []
        for i, span in zip(batch.order, batch.spans):
            state, _ = scheduled[i]
            start, end = span.start, span.start + span.num_tokens
            spans.extend((span.first_row, start, end, im) for im in state.images if im.overlaps(start, end))
        if not spans:
            return []
        self._encode(model, [im for *_, im in spans if im.content_hash not in self.rows])
        out = []
        for first_row, start, end, im in spans:
            lo, hi = max(start, im.offset), min(end, im.end)
            out.append(ImageRows(first_row + lo - start, self.rows[im.content_hash][lo - im.offset:hi - im.offset],
                                 (im.offset, im.end) if im.attend_whole else None))
        return out

    def _encode(self, model: torch.nn.Module, images: list[ImageInput]) -> None:
        unique = list({im.content_hash: im for im in images}.values())
        if not unique:
            return
        for im, rows in zip(unique, model.encode_images(unique, self.device)):
            if rows.shape[0] != im.length:
                raise ValueError(f"the image encodes to {rows.shape[0]} rows but its prompt holds "
                                 f"{im.length} placeholders")
            self.rows[im.content_hash] = rows


def embeddings_with_images(model: torch.nn.Module, input_ids: torch.Tensor, images: list[ImageRows]) -> torch.Tensor:
    """The flat batch's input embeddings, image placeholder rows replaced by their encoder rows."""
    x = model.embed_input_ids(input_ids)
    for part in images:
        x[part.first_row:part.first_row + part.rows.shape[0]] = part.rows.to(x.dtype)
    return x
