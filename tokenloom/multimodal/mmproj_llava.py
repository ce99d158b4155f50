"""LLaVA's mmproj (`clip.projector_type` "mlp"): a CLIP tower and a two-layer projector, as llama.cpp's LLaVA
converter writes them, described as a LLaVA config.json and a CLIPImageProcessor preprocessor_config.json.

Which tower output feeds the projector: `clip.vision.feature_layer` (hidden-state indices, 0 the embeddings
after the pre-norm, i the output of layer i; several are concatenated), else, as llama.cpp computes it, the
output of layer `block_count - 1`. The CLS row is dropped (transformers' "default" strategy; llama.cpp keeps
the patch rows only). The projector's activation is GELU, as in every LLaVA config.json.

Images are preprocessed as transformers' CLIPImageProcessor does for the same model (shortest edge to the
tower's size, centre crop), so the GGUF pair and the Hugging Face folder see the same pixels; llama.cpp pads
the image to a square instead, so its pixels (and output) differ for a non-square image.
"""
from __future__ import annotations

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.multimodal.mmproj_metadata import MmprojFile
from tokenloom.multimodal.mmproj_text import TextGGUF

IMAGE_TOKEN = "<image>"
BICUBIC = 3  # PIL's code; CLIP's processors resize bicubic
# Tensors of LLaVA variants this projector is not: LLaVA-NeXT's tiles, Yi-VL's normalised projector, a post-norm.
_REFUSED_TENSORS = {"model.image_newline": "LLaVA-NeXT's tiled images", "v.image_newline": "LLaVA-NeXT's tiled images",
                    "mm.3.weight": "a projector with norms (Yi-VL)",
                    "v.post_ln.weight": "a post-norm on the features"}


def llava_configs(mmproj: MmprojFile, text: TextGGUF) -> tuple[JsonObject, JsonObject, bool]:
    """(config.json, preprocessor_config.json, whether the prompt marks images with the media marker)."""
    for name, what in _REFUSED_TENSORS.items():
        if name in mmproj.tensor_shapes:
            raise ConfigError(f"--mmproj {mmproj.path}: {what} ({name}) is not supported")
    if "clip.vision.image_grid_pinpoints" in mmproj.metadata:
        raise ConfigError(f"--mmproj {mmproj.path}: LLaVA-NeXT's tiled images (image_grid_pinpoints) are not "
                          f"supported")
    hidden, blocks = mmproj.vision_int("embedding_length"), mmproj.vision_int("block_count")
    layers = mmproj.metadata.get("clip.vision.feature_layer", [blocks - 1])
    if not isinstance(layers, list) or not layers or any(not isinstance(i, int) or not 0 <= i <= blocks
                                                         for i in layers):
        raise ConfigError(f"--mmproj {mmproj.path}: clip.vision.feature_layer {layers!r} must be indices within "
                          f"the tower's {blocks} layers")
    inner, width_in = mmproj.shape("mm.0.weight")
    width_out, inner_2 = mmproj.shape("mm.2.weight")
    if width_in != hidden * len(layers) or inner_2 != inner or inner != width_out:
        raise ConfigError(f"--mmproj {mmproj.path}: projector shapes mm.0 {[inner, width_in]} and mm.2 "
                          f"{[width_out, inner_2]} do not fit a tower {hidden} wide read at {len(layers)} layer(s)")
    text.check_width(mmproj.path, width_out)
    image_size = mmproj.vision_int("image_size")
    act = "gelu" if mmproj.metadata.get("clip.use_gelu") else "silu" if mmproj.metadata.get("clip.use_silu") \
        else "quick_gelu"
    token = text.token_id(IMAGE_TOKEN)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": token if token is not None else len(text.vocab),
        "vision_feature_layer": list(layers), "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu", "multimodal_projector_bias": "mm.0.bias" in mmproj.tensor_shapes,
        "vision_config": {
            "hidden_size": hidden, "intermediate_size": mmproj.vision_int("feed_forward_length"),
            "num_hidden_layers": blocks, "num_attention_heads": mmproj.vision_int("attention.head_count"),
            "image_size": image_size, "patch_size": mmproj.vision_int("patch_size"),
            "layer_norm_eps": mmproj.vision_float("attention.layer_norm_epsilon", 1e-5), "hidden_act": act},
        "text_config": {"model_type": "llama", "hidden_size": text.hidden_size},
    }
    preprocessor = {
        "size": {"shortest_edge": image_size}, "crop_size": {"height": image_size, "width": image_size},
        "image_mean": mmproj.vision_floats("image_mean", 3), "image_std": mmproj.vision_floats("image_std", 3),
        "resample": BICUBIC,
    }
    return config, preprocessor, token is None
