"""What the mmproj side needs of a GGUF text model: its architecture, its width and its vocabulary (to find
the image tokens), read from the metadata alone."""
from __future__ import annotations

from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.tokenizer.gguf_metadata import GGUFMetadataError, read_gguf_metadata


@dataclass(frozen=True)
class TextGGUF:
    path: str
    architecture: str
    hidden_size: int
    vocab: dict[str, int]
    rope_sections: list[int]  # `<arch>.rope.dimension_sections` (Qwen2.5-VL's M-RoPE); empty when absent

    @classmethod
    def read(cls, path: str) -> "TextGGUF":
        try:
            meta = read_gguf_metadata(path)
        except (OSError, GGUFMetadataError) as exc:
            raise ConfigError(f"{path}: --mmproj needs a GGUF text model ({exc})") from None
        arch = meta.get("general.architecture")
        width = meta.get(f"{arch}.embedding_length")
        if not isinstance(arch, str) or not isinstance(width, int):
            raise ConfigError(f"{path}: GGUF metadata lacks general.architecture or its embedding_length")
        tokens = meta.get("tokenizer.ggml.tokens") or []
        sections = meta.get(f"{arch}.rope.dimension_sections") or []
        return cls(path, arch, width, {t: i for i, t in enumerate(tokens) if isinstance(t, str)},
                   [int(v) for v in sections if isinstance(v, int)])

    def token_id(self, text: str) -> int | None:
        return self.vocab.get(text)

    def check_width(self, mmproj_path: str, width: int) -> None:
        """The projector's rows must be as wide as this model's embeddings."""
        if width != self.hidden_size:
            raise ConfigError(f"--mmproj {mmproj_path}: its image embeddings are {width} wide but the text model "
                              f"{self.path} has hidden size {self.hidden_size}: the mmproj belongs to another model")
