"""LLaVA's model: the CLIP tower and projector give transformers' image features on the same weights, from
either checkpoint layout."""
from __future__ import annotations

import json
import os

import helpers
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenloom.config import MultiModalConfig
from tokenloom.model.loader import load_model
from tokenloom.multimodal.processor import ImageProcessor

CPU = torch.device("cpu")


def _pixels(folder: str, *images) -> torch.Tensor:
    processor = ImageProcessor.for_model(folder, MultiModalConfig())
    ids = [3] + [processor.placeholder_token_id] * len(images)
    _, inputs = processor.prepare(ids, list(images))
    return torch.stack([torch.from_numpy(np.frombuffer(i.pixel_values, np.float32).reshape(i.shape).copy())
                        for i in inputs])


def _hf_features(hf, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf.get_image_features(pixel_values=pixels)
    out = getattr(out, "pooler_output", out)
    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("strategy,layer", [("default", -2), ("full", -1), ("default", [1, -2])])
def test_image_features_equal_transformers(tmp_path, strategy, layer):
    hf = helpers.build_tiny_llava(str(tmp_path), select_strategy=strategy, feature_layer=layer)
    model = load_model(str(tmp_path), torch.float32, CPU, progress=False).model
    pixels = _pixels(str(tmp_path), helpers.tiny_image(40, 30, seed=1), helpers.tiny_image(17, 50, seed=2))
    with torch.no_grad():
        ours = model.encode(pixels)
    want = _hf_features(hf, pixels).reshape(ours.shape)
    assert ours.shape == (2, model.num_image_tokens, 64)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_in_the_newer_transformers_layout_loads_the_same_weights(tiny_llava, tmp_path):
    folder, hf = tiny_llava
    renamed = {}
    for name, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        elif name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    for extra in ("config.json", "preprocessor_config.json"):
        (tmp_path / extra).write_text(open(os.path.join(folder, extra)).read())
    old = load_model(folder, torch.float32, CPU, progress=False).model
    new = load_model(str(tmp_path), torch.float32, CPU, progress=False).model
    for (name, a), (_, b) in zip(old.state_dict().items(), new.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_tower_computes_only_up_to_the_deepest_layer_read(tiny_llava):
    folder, _ = tiny_llava
    model = load_model(folder, torch.float32, CPU, progress=False).model
    layers = json.load(open(os.path.join(folder, "config.json")))["vision_config"]["num_hidden_layers"]
    assert len(model.vision_tower.encoder.layers) == layers - 1  # vision_feature_layer -2
