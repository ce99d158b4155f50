"""Gemma 3's mmproj (`clip.projector_type` "gemma3"): the SigLIP tower and the pooling projector, described as a
Gemma 3 config.json and a Gemma3ImageProcessor preprocessor_config.json.

The pooled grid is `patches per side / clip.vision.projector.scale_factor` (4 when the file leaves it out, the
released models' 64 -> 16, 256 tokens per image). The image tokens are the text vocabulary's own
`<start_of_image>`, `<image_soft_token>` and `<end_of_image>`, as in a Gemma 3 folder.
"""
from __future__ import annotations

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.multimodal.mmproj_metadata import MmprojFile
from tokenloom.multimodal.mmproj_text import TextGGUF

IMAGE_TOKENS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                "image_token_index": "<image_soft_token>"}
DEFAULT_SCALE_FACTOR = 4  # llama.cpp's, when clip.vision.projector.scale_factor is absent
BILINEAR = 2  # PIL's code; Gemma 3's processor resizes bilinear


def gemma3_configs(mmproj: MmprojFile, text: TextGGUF) -> tuple[JsonObject, JsonObject, bool]:
    """(config.json, preprocessor_config.json, False: the vocabulary's own tokens mark images)."""
    ids = {key: text.token_id(token) for key, token in IMAGE_TOKENS.items()}
    missing = [IMAGE_TOKENS[key] for key, i in ids.items() if i is None]
    if missing:
        raise ConfigError(f"{text.path}: the vocabulary lacks Gemma 3's image token(s) {', '.join(missing)}")
    image_size, patch_size = mmproj.vision_int("image_size"), mmproj.vision_int("patch_size")
    scale = mmproj.vision_int("projector.scale_factor", DEFAULT_SCALE_FACTOR)
    side = image_size // patch_size // scale if patch_size and scale else 0
    if side == 0:
        raise ConfigError(f"--mmproj {mmproj.path}: image_size {image_size}, patch_size {patch_size} and scale "
                          f"factor {scale} leave no image tokens")
    vision_width, width = mmproj.shape("mm.input_projection.weight")
    if vision_width != mmproj.vision_int("embedding_length"):
        raise ConfigError(f"--mmproj {mmproj.path}: mm.input_projection.weight reads {vision_width} features, "
                          f"the tower gives {mmproj.vision_int('embedding_length')}")
    text.check_width(mmproj.path, width)
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], **ids, "mm_tokens_per_image": side * side,
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": vision_width,
            "intermediate_size": mmproj.vision_int("feed_forward_length"),
            "num_hidden_layers": mmproj.vision_int("block_count"),
            "num_attention_heads": mmproj.vision_int("attention.head_count"),
            "image_size": image_size, "patch_size": patch_size,
            "layer_norm_eps": mmproj.vision_float("attention.layer_norm_epsilon", 1e-6),
            "hidden_act": "gelu_pytorch_tanh"},
        "text_config": {"model_type": "gemma3_text", "hidden_size": text.hidden_size},
    }
    preprocessor = {"size": {"height": image_size, "width": image_size}, "resample": BILINEAR,
                    "image_mean": mmproj.vision_floats("image_mean", 3),
                    "image_std": mmproj.vision_floats("image_std", 3), "do_pan_and_scan": False}
    return config, preprocessor, False
