"""The Qwen2.5-VL vision tower equals transformers' `Qwen2_5_VisionTransformerPretrainedModel` on the same
random weights: window attention, the full-attention blocks, 2-D rotary and the patch merger, for square and
non-square images, images whose merged grid does not divide into windows, and several images in one call."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from tokenloom.config import ConfigError
from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VisionTower
from tokenloom.multimodal.errors import ImageInputError

# A window of 56 pixels is 2x2 merged tokens, so grids of 4+ merged tokens per side hold several windows.
TINY_VISION = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                   patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                   fullatt_block_indexes=[1], in_channels=3)


@pytest.fixture(scope="module")
def towers():
    torch.manual_seed(0)
    hf_config = Qwen2_5_VLConfig(vision_config=TINY_VISION).vision_config
    hf_config._attn_implementation = "sdpa"
    reference = Qwen2_5_VisionTransformerPretrainedModel(hf_config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
    ours = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(hf_config.to_dict()))
    missing = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return reference, ours


def _random_patches(grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 14 * 14, generator=generator)


def _assert_same_features(towers, grids):
    reference, ours = towers
    pixels = _random_patches(grids)
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        want = reference(pixels, grid_thw=grid_thw).pooler_output
    got = ours.encode(pixels, grid_thw)
    assert [g.shape[0] for g in got] == [t * h * w // 4 for t, h, w in grids]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 8, 8), (1, 6, 10), (1, 14, 6), (1, 2, 2)],
                         ids=["one-window", "four-windows", "wide-partial-windows", "tall-partial-windows",
                              "smaller-than-a-window"])
def test_one_image_matches_transformers(towers, grid):
    _assert_same_features(towers, [grid])


def test_several_images_of_different_sizes_in_one_call_match_transformers(towers):
    _assert_same_features(towers, [(1, 6, 10), (1, 4, 4), (1, 10, 6)])


def test_a_two_frame_grid_matches_transformers(towers):
    _assert_same_features(towers, [(2, 6, 6)])


def test_each_image_gets_its_own_tensor_of_merged_tokens_given_the_processors_numpy_grid(towers):
    _, ours = towers
    grids = [(1, 4, 6), (1, 8, 2)]
    features = ours.encode(_random_patches(grids), np.array(grids, dtype=np.int64))
    assert [tuple(f.shape) for f in features] == [(6, 48), (4, 48)]


def test_pixel_rows_that_disagree_with_the_grid_are_refused(towers):
    _, ours = towers
    with pytest.raises(ImageInputError, match="describes 16 patches"):
        ours.encode(_random_patches([(1, 4, 2)]), [(1, 4, 4)])


def test_a_grid_that_is_not_a_multiple_of_the_merge_size_is_refused(towers):
    _, ours = towers
    with pytest.raises(ImageInputError, match="merge size"):
        ours.encode(_random_patches([(1, 3, 4)]), [(1, 3, 4)])


def test_a_window_that_does_not_tile_merged_patches_is_a_config_error():
    with pytest.raises(ConfigError, match="window_size"):
        Qwen2_5_VLVisionConfig.from_hf({**TINY_VISION, "window_size": 50})


def test_a_call_without_images_is_refused(towers):
    _, ours = towers
    with pytest.raises(ImageInputError, match="no images"):
        ours.encode(_random_patches([]), [])


def test_the_released_3b_vision_config_is_read():
    released = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 2, "temporal_patch_size": 2}
    config = Qwen2_5_VLVisionConfig.from_hf(released)
    assert (config.head_dim, config.patch_pixels, config.rope_theta) == (80, 1176, 10000.0)


def test_images_encoded_together_equal_each_encoded_alone(towers):
    _, ours = towers
    grids = [(1, 6, 10), (1, 4, 4)]
    pixels = _random_patches(grids)
    together = ours.encode(pixels, grids)
    alone = [ours.encode(p, [g])[0] for p, g in zip(pixels.split([60, 16]), grids)]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_in_bfloat16_the_tower_is_as_close_to_float32_as_transformers_is(towers):
    reference, ours = towers
    grids = [(1, 8, 6)]
    pixels, grid_thw = _random_patches(grids), torch.tensor(grids)
    with torch.no_grad():
        exact = reference(pixels, grid_thw=grid_thw).pooler_output
        reference_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
        theirs = reference_bf16(pixels.bfloat16(), grid_thw=grid_thw).pooler_output.float()
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    got = torch.cat(ours_bf16.encode(pixels.bfloat16(), grids)).float()
    assert (got - exact).abs().max() <= 2 * (theirs - exact).abs().max()
