"""A prompt's image placeholder token, expanded to the positions the image's encoder rows will fill."""
from __future__ import annotations

from tokenloom.multimodal.errors import ImageInputError


def expand_placeholders(token_ids: list[int], placeholder: int, num_images: int,
                        tokens_per_image: int) -> tuple[list[int], list[int]]:
    """The prompt with each `placeholder` token repeated `tokens_per_image` times, and where each image's run
    starts. The prompt must name every image once: as many placeholders as images."""
    found = token_ids.count(placeholder)
    if found != num_images:
        raise ImageInputError(f"the prompt has {found} image placeholder(s) but {num_images} image(s) were given "
                              f"(one placeholder per image, in order)")
    expanded: list[int] = []
    offsets: list[int] = []
    for token in token_ids:
        if token == placeholder:
            offsets.append(len(expanded))
            expanded.extend([placeholder] * tokens_per_image)
        else:
            expanded.append(token)
    return expanded, offsets
