"""Qwen2.5-VL preprocessing gives the pixels and grids of transformers' Qwen2VLImageProcessor (its PIL backend,
the one it uses without torchvision): smart_resize's size, bicubic resize, rescale, normalisation, and the
merge-square patch order."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from tokenloom.multimodal.qwen2_5_vl_preprocess import (
    ImageSizeError,
    Qwen2VLPreprocessConfig,
    preprocess_images,
    smart_resize,
)

# Small pixel budgets keep the images (and the test) small; the arithmetic is the same as the released 3136..1003520.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 48


def _noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode)


def _reference(images):
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return processor(images=images, return_tensors="np")


def _ours(images):
    return preprocess_images(images, Qwen2VLPreprocessConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))


@pytest.mark.parametrize("height,width", [(100, 100), (1000, 30), (30, 1000), (5, 7), (3000, 4000), (28, 28 * 50),
                                          (123, 457)])
def test_smart_resize_picks_transformers_size(height, width):
    assert smart_resize(height, width, 28, MIN_PIXELS, MAX_PIXELS) == hf_smart_resize(
        height, width, 28, MIN_PIXELS, MAX_PIXELS)


@pytest.mark.parametrize("width,height", [(112, 112), (200, 90), (70, 260), (20, 30), (400, 300)],
                         ids=["square-exact", "wide", "tall", "upscaled-small", "downscaled-large"])
def test_one_image_gives_transformers_pixels_and_grid(width, height):
    image = _noise_image(width, height)
    want, got = _reference([image]), _ours([image])
    np.testing.assert_array_equal(got.image_grid_thw, want["image_grid_thw"])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)


def test_several_images_are_concatenated_in_order_like_transformers():
    images = [_noise_image(200, 90, seed=1), _noise_image(56, 56, seed=2), _noise_image(70, 260, seed=3)]
    want, got = _reference(images), _ours(images)
    np.testing.assert_array_equal(got.image_grid_thw, want["image_grid_thw"])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_transparent_and_grey_images_become_rgb_like_transformers(mode):
    image = _noise_image(150, 100, mode=mode)
    want, got = _reference([image]), _ours([image])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)


def test_placeholder_count_is_one_token_per_merge_square():
    got = _ours([_noise_image(200, 90), _noise_image(56, 56)])
    assert got.tokens_per_image(merge_size=2) == [int(t * h * w) // 4 for t, h, w in got.image_grid_thw]


def test_a_needle_thin_image_is_refused():
    with pytest.raises(ImageSizeError, match="more elongated"):
        _ours([_noise_image(2010, 10)])


def test_an_image_without_pixels_is_refused():
    with pytest.raises(ImageSizeError, match="no pixels"):
        smart_resize(0, 10, 28, MIN_PIXELS, MAX_PIXELS)


def test_the_released_config_spelling_is_read():
    config = Qwen2VLPreprocessConfig.from_hf({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                                              "temporal_patch_size": 2, "merge_size": 2, "resample": 3})
    assert (config.min_pixels, config.max_pixels, config.resample) == (3136, 12845056, "bicubic")
