"""Images on the frontend's side: decoding within limits, CLIP preprocessing equal to transformers', content
hashes, and placeholder expansion."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tokenloom.multimodal.clip_preprocess import CLIPPreprocessConfig, clip_preprocess
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.image_decode import ImageLimits, decode_image, rgb
from tokenloom.multimodal.image_hash import image_content_hash
from tokenloom.multimodal.placeholders import expand_placeholders

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20)


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("size,mode", [((60, 40), "RGB"), ((40, 61), "RGB"), ((20, 15), "RGB"), ((50, 50), "RGBA"),
                                       ((33, 70), "L"), ((336, 200), "RGB")])
@pytest.mark.parametrize("processor", [
    dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
    dict(size={"shortest_edge": 36}, crop_size={"height": 30, "width": 34}),
    dict(size={"height": 32, "width": 24}, crop_size={"height": 24, "width": 24}, resample=2),
])
def test_clip_preprocessing_equals_transformers_pixel_for_pixel(size, mode, processor):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    image = _image(*size, mode=mode)
    want = CLIPImageProcessorPil(**processor)(images=image, return_tensors="np")["pixel_values"][0]
    got = clip_preprocess(rgb(image), CLIPPreprocessConfig.from_json(processor))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_a_decoded_image_is_rgb_whatever_its_mode():
    assert decode_image(_encoded(_image(9, 7, "L")), LIMITS).mode == "RGB"
    assert decode_image(_encoded(_image(9, 7, "RGBA")), LIMITS).size == (9, 7)


def test_a_truncated_image_is_a_clear_error():
    data = _encoded(_image(64, 64), "JPEG")
    with pytest.raises(ImageInputError, match="not a decodable image"):
        decode_image(data[: len(data) // 2], LIMITS)


def test_bytes_that_are_no_image_are_a_clear_error():
    with pytest.raises(ImageInputError, match="not a decodable image"):
        decode_image(b"%PDF-1.4 this is a document, not a picture", LIMITS)


def test_an_image_over_the_byte_limit_is_refused_before_decoding():
    data = _encoded(_image(64, 64))
    with pytest.raises(ImageInputError, match="bytes; the limit"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1, max_pixels=1 << 20))


def test_an_image_over_the_pixel_limit_is_refused_from_its_header():
    with pytest.raises(ImageInputError, match="pixels"):
        decode_image(_encoded(_image(100, 100)), ImageLimits(max_bytes=1 << 20, max_pixels=100 * 99))


def test_a_decompression_bomb_is_refused_without_decoding_its_pixels():
    bomb = Image.new("L", (20000, 20000))  # a few kB as PNG, 400 MB decoded
    data = _encoded(bomb)
    assert len(data) < 1 << 20
    with pytest.raises(ImageInputError, match="pixels"):
        decode_image(data, LIMITS)


def test_the_same_pixels_hash_alike_whatever_file_format_carried_them():
    image = _image(40, 30)
    config = CLIPPreprocessConfig.from_json(dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}))
    from_png = clip_preprocess(decode_image(_encoded(image, "PNG"), LIMITS), config)
    from_bmp = clip_preprocess(decode_image(_encoded(image, "BMP"), LIMITS), config)
    assert image_content_hash(from_png) == image_content_hash(from_bmp)


def test_different_images_hash_differently():
    config = CLIPPreprocessConfig.from_json(dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}))
    a = clip_preprocess(_image(40, 30, seed=1), config)
    b = clip_preprocess(_image(40, 30, seed=2), config)
    assert image_content_hash(a) != image_content_hash(b)


def test_each_placeholder_expands_to_its_images_token_count():
    ids, offsets = expand_placeholders([5, 9, 6, 9, 7], placeholder=9, lengths=[3, 2])
    assert ids == [5, 9, 9, 9, 6, 9, 9, 7]
    assert offsets == [1, 5]


def test_a_prompt_with_fewer_placeholders_than_images_is_refused():
    with pytest.raises(ImageInputError, match="1 image placeholder"):
        expand_placeholders([5, 9, 6], placeholder=9, lengths=[3, 3])
