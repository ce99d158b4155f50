"""The vision encoders fill from the tensors of a saved checkpoint by name: a transformers 5 save of
Qwen2.5-VL and of Gemma 3 (and Gemma 3's released spelling, `vision_tower.vision_model.*`) gives encoders whose
outputs equal the saved model's `get_image_features`; a checkpoint missing a tensor says which."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from tokenloom.model.model_errors import CorruptModelError
from tokenloom.model.models.vision.checkpoint_names import load_encoder_weights
from tokenloom.model.models.vision.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder
from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VisionTower

TEXT = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _randomize_vision(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" not in name and "lm_head" not in name and "embed_tokens" not in name:
                p.normal_(0, 0.2)


def _saved_tensors(model, folder) -> list[tuple[str, torch.Tensor]]:
    model.save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return [(name, f.get_tensor(name)) for name in f.keys()]


@pytest.fixture(scope="module")
def qwen_saved(tmp_path_factory):
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1]))
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _randomize_vision(model)
    return model, _saved_tensors(model, tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def gemma_saved(tmp_path_factory):
    config = Gemma3Config(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=7, vision_use_head=False),
        text_config={**TEXT, "head_dim": 16}, mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize_vision(model)
    return model, _saved_tensors(model, tmp_path_factory.mktemp("gemma"))


def test_a_saved_qwen2_5_vl_fills_the_tower_and_it_matches_the_saved_model(qwen_saved):
    model, tensors = qwen_saved
    tower = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(model.config.vision_config.to_dict()))
    load_encoder_weights(tower, tensors, tower.CHECKPOINT_PREFIXES)
    grids = torch.tensor([[1, 8, 6], [1, 4, 4]])
    pixels = torch.randn(64, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.model.get_image_features(pixels, grids).pooler_output
    for got, expected in zip(tower.encode(pixels, grids), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spelling", ["transformers-5-save", "released"])
def test_a_saved_gemma3_fills_the_encoder_and_it_matches_the_saved_model(gemma_saved, spelling):
    model, tensors = gemma_saved
    if spelling == "released":
        tensors = [(n.replace("vision_tower.", "vision_tower.vision_model.", 1), t) for n, t in tensors]
    encoder = Gemma3VisionEncoder(Gemma3VisionConfig.from_hf(model.config.to_dict()))
    load_encoder_weights(encoder, tensors, encoder.CHECKPOINT_PREFIXES)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(torch.stack(encoder.encode(pixels)), want, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_missing_a_vision_tensor_names_it(qwen_saved):
    model, tensors = qwen_saved
    tower = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(model.config.vision_config.to_dict()))
    without = [(n, t) for n, t in tensors if n != "visual.merger.ln_q.weight"]
    with pytest.raises(CorruptModelError, match="merger.ln_q.weight"):
        load_encoder_weights(tower, without, tower.CHECKPOINT_PREFIXES)


def test_a_vision_tensor_of_the_wrong_shape_is_named(qwen_saved):
    model, tensors = qwen_saved
    tower = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(model.config.vision_config.to_dict()))
    cut = [(n, t[:16] if n == "visual.blocks.0.attn.proj.bias" else t) for n, t in tensors]
    with pytest.raises(CorruptModelError, match=r"blocks.0.attn.proj.bias \[16\]"):
        load_encoder_weights(tower, cut, tower.CHECKPOINT_PREFIXES)
