"""Image content parts of chat messages: taken out for loading, replaced by the `{"type": "image"}` part chat
templates of vision-language models render as their image placeholder.

Accepted parts: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string), the
Responses API's `{"type": "input_image", "image_url": ...}`, and offline only `{"type": "image_pil",
"image_pil": PIL.Image}`. Messages without image parts are left as they are. For a GGUF served with its mmproj
file, whose chat template is a text model's, a message with images becomes text with the image token written
where each image stands.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from PIL import Image

from tokenloom.multimodal.errors import ImageInputError

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")
ImageRef = str | Image.Image  # a URL to load, or an image already decoded


def image_part_ref(part: Mapping[str, object]) -> ImageRef:
    """The image one content part names."""
    kind = part.get("type")
    value = part.get(kind if kind != "input_image" else "image_url")
    if kind == "image_pil":
        if not isinstance(value, Image.Image):
            raise ImageInputError("an image_pil part needs a PIL image", "messages")
        return value
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageInputError(f"an {kind} part needs an image URL (a data: URL, or http(s):// where the server "
                              f"allows it)", "messages")
    return value


def split_image_parts(messages: Sequence[Mapping[str, object]],
                      image_text: str | None = None) -> tuple[list[dict], list[ImageRef]]:
    """The messages as the chat template sees them, and their images in order. `image_text`: a message with
    images becomes one string, its parts joined by newlines with `image_text` for each image (for a template
    that renders text only, a GGUF's; llama.cpp's server writes its media marker the same way)."""
    out, images = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES
                                                    for p in content):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                images.append(image_part_ref(part))
                parts.append({"type": "image"})
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                parts.append({"type": "text", "text": part.get("text")})
            else:
                parts.append(dict(part) if isinstance(part, Mapping) else part)
        if image_text is not None:
            parts = "\n".join(image_text if p.get("type") == "image" else str(p.get("text") or "") for p in parts
                               if isinstance(p, Mapping))
        out.append({**message, "content": parts})
    return out, images
