"""A GGUF text model and a llama.cpp mmproj file, described as the Hugging Face folder of the same model would
describe itself: a config.json (architecture, vision_config, image token ids, the text model's width) and a
preprocessor_config.json. Built once from the two files' metadata, it lets the engine and the frontend serve
them through the same model classes and image families as the folder (`FAMILIES`, the model registry).

One builder per projector type (`clip.projector_type`): LLaVA's `mlp` (mmproj_llava.py), Gemma 3's `gemma3`
(mmproj_gemma3.py) and Qwen2.5-VL's `qwen2.5vl_merger` (mmproj_qwen2_5_vl.py). Any other type, a text model of
an architecture the projector does not feed, or a projector whose output width is not the text model's hidden
size is refused with a one-line ConfigError.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.multimodal.mmproj_gemma3 import gemma3_configs
from tokenloom.multimodal.mmproj_llava import llava_configs
from tokenloom.multimodal.mmproj_metadata import MmprojFile, read_mmproj
from tokenloom.multimodal.mmproj_qwen2_5_vl import qwen2_5_vl_configs
from tokenloom.multimodal.mmproj_text import TextGGUF


@dataclass(frozen=True)
class GGUFVisionConfig:
    projector_type: str  # clip.projector_type
    model_config: JsonObject  # as a config.json
    preprocessor_config: JsonObject  # as a preprocessor_config.json
    # The prompt marks an image with MEDIA_MARKER, which the tokenizer gains as a token of its own: the text
    # model's vocabulary has no image token (LLaVA 1.5 GGUFs made from the original checkpoint).
    uses_marker: bool = False


# clip.projector_type -> (the text architectures it feeds, the builder)
Builder = Callable[[MmprojFile, TextGGUF], tuple[JsonObject, JsonObject, bool]]
PROJECTORS: dict[str, tuple[tuple[str, ...], Builder]] = {
    "mlp": (("llama", "mistral"), llava_configs),
    "gemma3": (("gemma3",), gemma3_configs),
    "qwen2.5vl_merger": (("qwen2vl",), qwen2_5_vl_configs),
}


def gguf_vision_config(model_path: str, mmproj_path: str) -> GGUFVisionConfig:
    mmproj = read_mmproj(mmproj_path)
    kind = mmproj.projector_type
    if kind not in PROJECTORS:
        raise ConfigError(f"--mmproj {mmproj_path}: projector type {kind!r} is not supported (supported: "
                          f"{', '.join(PROJECTORS)})")
    text = TextGGUF.read(model_path)
    architectures, build = PROJECTORS[kind]
    if text.architecture not in architectures:
        raise ConfigError(f"{model_path}: a {text.architecture!r} text model cannot take the images of a "
                          f"{kind!r} projector (--mmproj {mmproj_path}; it feeds {', '.join(architectures)})")
    model_config, preprocessor_config, uses_marker = build(mmproj, text)
    return GGUFVisionConfig(kind, model_config, preprocessor_config, uses_marker)

