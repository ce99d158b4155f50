"""A prompt's image placeholder token, expanded to the positions the image's encoder rows will fill."""
from __future__ import annotations

from tokenloom.multimodal.errors import ImageInputError


def expand_placeholders(token_ids: list[int], placeholder: int, lengths: list[int]) -> tuple[list[int], list[int]]:
    """The prompt with the i-th `placeholder` token repeated `lengths[i]` times (the i-th image's encoder rows),
    and where each image's run starts. The prompt must name every image once: as many placeholders as images."""
    found = token_ids.count(placeholder)
    if found != len(lengths):
        raise ImageInputError(f"the prompt has {found} image placeholder(s) but {len(lengths)} image(s) were given "
                              f"(one placeholder per image, in order)")
    expanded: list[int] = []
    offsets: list[int] = []
    for token in token_ids:
        if token == placeholder:
            expanded.extend([placeholder] * lengths[len(offsets)])
            offsets.append(len(expanded) - lengths[len(offsets)])
        else:
            expanded.append(token)
    return expanded, offsets
