"""Qwen2.5-VL's mmproj (`clip.projector_type` "qwen2.5vl_merger"): the windowed vision tower and the patch
merger, described as a Qwen2.5-VL config.json and a Qwen2-VL preprocessor_config.json, beside a text GGUF of
architecture `qwen2vl` whose `rope.dimension_sections` are the M-RoPE sections.

The file states the tower's sizes and `clip.vision.n_wa_pattern` (every n-th block attends over the whole image:
blocks n-1, 2n-1, ...); the merge size (`clip.vision.spatial_merge_size`) and the window
(`clip.vision.window_size`) are the released 2 and 112 pixels when absent, and the image's pixel bounds
(`clip.vision.image_min_pixels`/`image_max_pixels`) those of the released preprocessor_config.json, so the pair
sees the pixels the Hugging Face folder does (llama.cpp bounds images at 8..4096 tokens instead).
"""
from __future__ import annotations

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.multimodal.mmproj_metadata import MmprojFile
from tokenloom.multimodal.mmproj_text import TextGGUF

IMAGE_TOKENS = {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                "vision_end_token_id": "<|vision_end|>"}
TEMPORAL_PATCH_SIZE = 2  # llama.cpp's converter splits the two frames of the patch convolution
DEFAULT_MERGE_SIZE, DEFAULT_WINDOW = 2, 112
# Qwen2.5-VL's released preprocessor_config.json
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
BICUBIC = 3


def qwen2_5_vl_configs(mmproj: MmprojFile, text: TextGGUF) -> tuple[JsonObject, JsonObject, bool]:
    """(config.json, preprocessor_config.json, False: the vocabulary's own tokens mark images)."""
    ids = {key: text.token_id(token) for key, token in IMAGE_TOKENS.items()}
    missing = [IMAGE_TOKENS[key] for key, i in ids.items() if i is None]
    if missing:
        raise ConfigError(f"{text.path}: the vocabulary lacks Qwen2.5-VL's image token(s) {', '.join(missing)}")
    if len(text.rope_sections) < 3 or any(text.rope_sections[3:]):
        raise ConfigError(f"{text.path}: a Qwen2.5-VL text model needs {text.architecture}.rope.dimension_sections "
                          f"(three M-RoPE sections; got {text.rope_sections})")
    depth, hidden = mmproj.vision_int("block_count"), mmproj.vision_int("embedding_length")
    pattern = mmproj.vision_int("n_wa_pattern")
    if pattern == 0:
        raise ConfigError(f"--mmproj {mmproj.path}: clip.vision.n_wa_pattern must be positive")
    merge = mmproj.vision_int("spatial_merge_size", DEFAULT_MERGE_SIZE)
    merged, width_in = mmproj.shape("mm.0.weight")
    width, merged_2 = mmproj.shape("mm.2.weight")
    if width_in != hidden * merge * merge or merged_2 != merged:
        raise ConfigError(f"--mmproj {mmproj.path}: merger shapes mm.0 {[merged, width_in]} and mm.2 "
                          f"{[width, merged_2]} do not fit a tower {hidden} wide merged {merge} x {merge}")
    text.check_width(mmproj.path, width)
    patch = mmproj.vision_int("patch_size")
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], **ids,
        "rope_scaling": {"type": "mrope", "mrope_section": text.rope_sections[:3]},
        "vision_config": {
            "depth": depth, "hidden_size": hidden, "intermediate_size": mmproj.vision_int("feed_forward_length"),
            "num_heads": mmproj.vision_int("attention.head_count"), "out_hidden_size": width, "patch_size": patch,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE, "spatial_merge_size": merge,
            "window_size": mmproj.vision_int("window_size", DEFAULT_WINDOW),
            "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0], "hidden_act": "silu"},
    }
    preprocessor = {
        "min_pixels": mmproj.vision_int("image_min_pixels", MIN_PIXELS),
        "max_pixels": mmproj.vision_int("image_max_pixels", MAX_PIXELS),
        "patch_size": patch, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "merge_size": merge, "resample": BICUBIC,
        "image_mean": mmproj.vision_floats("image_mean", 3), "image_std": mmproj.vision_floats("image_std", 3),
    }
    return config, preprocessor, False
