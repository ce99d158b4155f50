"""Gemma 3's image encoder (SigLIP tower + pooling projector) equals transformers' Gemma3Model.get_image_features
on the same random weights, and its preprocessing gives the pixels of transformers' Gemma3 and SigLIP image
processors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma3Config
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import Gemma3Model
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from tokenloom.config import ConfigError
from tokenloom.model.models.vision.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.gemma3_preprocess import SiglipPreprocessConfig, preprocess_images

# 56 / 7 = an 8x8 patch grid pooled 2x2 to 16 tokens (the released 896 / 14 = 64x64 pools 4x4 to 256).
TINY = dict(
    vision_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       image_size=56, patch_size=7, vision_use_head=False),
    text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=24, vocab_size=300),
    mm_tokens_per_image=16)


@pytest.fixture(scope="module")
def encoders():
    torch.manual_seed(0)
    hf_config = Gemma3Config(**TINY)
    reference = Gemma3Model(hf_config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if not name.startswith("language_model."):
                p.normal_(0, 0.2)
    ours = Gemma3VisionEncoder(Gemma3VisionConfig.from_hf(hf_config.to_dict()))
    theirs = reference.state_dict()
    # transformers keeps SigLIP's modules one level up from the checkpoint's `vision_tower.vision_model.`
    state = {name: theirs[name.replace("vision_tower.vision_model.", "vision_tower.")]
             for name in ours.state_dict()}
    ours.load_state_dict(state, strict=True)
    return reference, ours


def _assert_same_features(encoders, images: int, seed: int = 1):
    reference, ours = encoders
    pixels = torch.randn(images, 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = reference.get_image_features(pixels).pooler_output
    got = ours.encode(pixels)
    assert [tuple(g.shape) for g in got] == [(16, 48)] * images
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_one_image_matches_transformers(encoders):
    _assert_same_features(encoders, 1)


def test_a_batch_of_images_matches_transformers(encoders):
    _assert_same_features(encoders, 3, seed=2)


def test_parameter_names_are_the_released_checkpoints(encoders):
    _, ours = encoders
    names = set(ours.state_dict())
    assert "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight" in names
    assert "vision_tower.vision_model.embeddings.position_embedding.weight" in names
    assert {"multi_modal_projector.mm_input_projection_weight",
            "multi_modal_projector.mm_soft_emb_norm.weight"} <= names


def test_pixels_of_the_wrong_size_are_refused(encoders):
    _, ours = encoders
    with pytest.raises(ImageInputError, match="3, 56, 56"):
        ours.encode(torch.zeros(1, 3, 64, 56))


def test_a_token_count_that_does_not_pool_the_grid_evenly_is_a_config_error():
    with pytest.raises(ConfigError, match="pool evenly"):
        Gemma3VisionConfig.from_hf(Gemma3Config(**{**TINY, "mm_tokens_per_image": 9}).to_dict())


def _noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return Image.fromarray(data, mode=mode)


@pytest.mark.parametrize("width,height", [(56, 56), (200, 90), (31, 77)], ids=["same-size", "wide", "tall-small"])
def test_preprocessing_equals_transformers_gemma3_processor(width, height):
    images = [_noise_image(width, height), _noise_image(height, width, mode="RGBA", seed=3)]
    want = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})(images=images, return_tensors="np")
    got = preprocess_images(images, SiglipPreprocessConfig(height=56, width=56))
    np.testing.assert_allclose(got, want["pixel_values"], rtol=0, atol=1e-6)


def test_preprocessing_equals_transformers_siglip_processor_with_its_bicubic_default():
    images = [_noise_image(120, 80, seed=5)]
    want = SiglipImageProcessorPil(size={"height": 56, "width": 56})(images=images, return_tensors="np")
    got = preprocess_images(images, SiglipPreprocessConfig(height=56, width=56, resample="bicubic"))
    np.testing.assert_allclose(got, want["pixel_values"], rtol=0, atol=1e-6)


def test_a_released_preprocessor_config_is_read_and_pan_and_scan_refused():
    released = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
                "resample": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "rescale_factor": 0.00392156862745098, "do_pan_and_scan": None}
    config = SiglipPreprocessConfig.from_hf(released)
    assert (config.height, config.width, config.resample) == (896, 896, "bilinear")
    with pytest.raises(ConfigError, match="do_pan_and_scan"):
        SiglipPreprocessConfig.from_hf({**released, "do_pan_and_scan": True})
