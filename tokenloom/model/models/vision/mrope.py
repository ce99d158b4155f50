"""Qwen2.5-VL's multimodal rotary positions (M-RoPE): each token has three positions (time, row, column) and
each third of the rotary frequencies turns with one of them (`mrope_section` pairs each).

Text tokens carry the same number in all three streams, counting up by one as in a plain rope. An image's
placeholder tokens (one per merged patch square, row-major) all start from the position after the text
before them: time stays there, row and column add the token's row and column in the merged grid. The text
after the image resumes at that start plus the grid's longer side. So a prompt's last position is usually
less than its length; `delta` (next position - prompt length) carries the difference into decoding, where
every stream is `index + delta`. The same rules as transformers' `Qwen2_5_VLModel.get_rope_index`, for
images (videos, whose time axis advances by `tokens_per_second`, are not handled here).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from tokenloom.config import ConfigError
from tokenloom.core.multimodal import ImageInput
from tokenloom.kernels import layer_ops
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.rotary import RotaryEmbedding
from tokenloom.model.models.vision.qwen2_5_vl_grid import GridInput, grids_of
from tokenloom.multimodal.errors import ImageInputError


class ImagePlaceholderError(ImageInputError):
    """A prompt's image placeholder tokens do not match the images given with it."""


class PromptRope(NamedTuple):
    """A prompt's M-RoPE: `positions` [3, P] of its tokens, and `delta`, which every later token (index i)
    adds to its index in all three streams."""

    positions: torch.Tensor
    delta: int

    def streams(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of the tokens at indices start .. end - 1 (prompt or decoded)."""
        prompt_len = self.positions.shape[1]
        inside = self.positions[:, start:min(end, prompt_len)]
        if end <= prompt_len:
            return inside
        return torch.cat([inside, mrope_decode_positions(max(start, prompt_len), end - max(start, prompt_len),
                                                         self.delta)], dim=1)


def mrope_positions(token_ids: torch.Tensor | Sequence[int], image_token_id: int,
                    image_grid_thw: GridInput,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, len(token_ids)] int64 positions, delta) for a prompt whose images' placeholders appear in order,
    each a run of frames x rows x columns / merge**2 `image_token_id` tokens."""
    token_ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    grids = grids_of(image_grid_thw)
    streams: list[torch.Tensor] = []
    next_position, index, image = 0, 0, 0
    while index < len(token_ids):
        if token_ids[index] != image_token_id:
            run = index
            while run < len(token_ids) and token_ids[run] != image_token_id:
                run += 1
            streams.append(torch.arange(next_position, next_position + run - index).expand(3, -1))
            next_position += run - index
            index = run
            continue
        if image == len(grids):
            raise ImagePlaceholderError(f"the prompt has more image placeholders than the {len(grids)} "
                                        "image(s) given")
        frames, rows, cols = grids[image]
        rows, cols = rows // spatial_merge_size, cols // spatial_merge_size
        count = frames * rows * cols
        if any(t != image_token_id for t in token_ids[index:index + count]):
            raise ImagePlaceholderError(f"image {image} needs {count} consecutive placeholder tokens at "
                                        f"position {index}")
        time, row, col = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols),
                                        indexing="ij")
        streams.append(torch.stack([time, row, col]).reshape(3, -1) + next_position)
        next_position += max(rows, cols)
        index += count
        image += 1
    if image != len(grids):
        raise ImagePlaceholderError(f"{len(grids)} image(s) given, the prompt has placeholders for {image}")
    if not streams:
        raise ImagePlaceholderError("an empty prompt has no positions")
    positions = torch.cat(streams, dim=1)
    return positions, int(positions.max()) + 1 - len(token_ids)


def mrope_decode_positions(first_index: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] positions of the tokens at prompt+output indices first_index.. (all streams equal)."""
    return torch.arange(first_index + delta, first_index + delta + count).expand(3, -1)


@runtime_checkable
class MRopeModel(Protocol):
    """A model whose prompts with images take M-RoPE positions (the runner asks it once per such prompt)."""

    def prompt_rope(self, token_ids: list[int], images: list[ImageInput]) -> PromptRope: ...


@functools.cache
def takes_mrope(model_class: type) -> bool:
    """Whether a model class is an `MRopeModel` (a Protocol check costs ~10 us: once per class)."""
    return issubclass(model_class, MRopeModel)


class MRotaryEmbedding(InferenceModule):
    """Rotate-half rotary embedding whose frequency pairs take their angle from one of three position streams:
    the first mrope_section[0] pairs from time, the next mrope_section[1] from row, the rest from column."""

    def __init__(self, head_dim: int, theta: float, mrope_section: Sequence[int]):
        super().__init__()
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ConfigError(f"rope_scaling.mrope_section {list(mrope_section)} must be three numbers summing to "
                              f"head_dim / 2 = {head_dim // 2}")
        self.head_dim, self.theta, self.mrope_section = head_dim, theta, list(mrope_section)
        inv_freq, stream_of_pair = self._tables(torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("stream_of_pair", stream_of_pair, persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(frequency of each pair, the stream each pair's angle comes from)."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device)
                                         / self.head_dim))
        sections = torch.tensor(self.mrope_section, device=device)
        return inv_freq, torch.repeat_interleave(torch.arange(3, device=device), sections)

    def rebuild_buffers(self, device: torch.device) -> None:
        self.inv_freq, self.stream_of_pair = self._tables(device)
        self._last = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] (or [T] for text alone) -> cos, sin: [T, head_dim / 2]."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        angles = positions[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        angles = angles.gather(0, self.stream_of_pair.expand(1, angles.shape[1], -1)).squeeze(0)
        return angles.cos(), angles.sin()

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, row of each token): every layer shares this module and one positions tensor within a
        forward, so the angles are computed once per forward instead of once per layer."""
        if self._last is None or self._last[0] is not positions:
            cos, sin = self.cos_sin(positions)
            self._last = (positions, cos, sin, torch.arange(cos.shape[0], device=cos.device))
        return self._last[1], self._last[2], self._last[3]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D] rotated by the positions' angles."""
        cos, sin, rows = self._angles(positions)
        if layer_ops.native(q) and k.dtype == torch.float32:
            # The native op reads angles from a table by position: here each token's row is its own entry.
            return torch.ops.tokenloom.rotary_embedding(rows, q, k, cos, sin)
        cos, sin = cos[:, None], sin[:, None]
        return layer_ops.rotate_half(q, cos, sin), layer_ops.rotate_half(k, cos, sin)


class TextMRotaryEmbedding(RotaryEmbedding):
    """Qwen2.5-VL's text rotary. Where the three streams are equal (text, and every decode) M-RoPE is the plain
    rotary at that position, so 1-D positions take the plain tables and their fast paths (native op, CUDA
    graphs, the native decoder stack); only a forward over image tokens passes [3, T] positions, rotated
    section by section."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, mrope_section: Sequence[int]):
        super().__init__(head_dim, max_positions, theta, None)
        self.sections = MRotaryEmbedding(head_dim, theta, mrope_section)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 2:
            return self.sections(positions, q, k)
        return super().forward(positions, q, k)
