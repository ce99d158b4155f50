"""Pooling: one embedding per sequence from its last hidden states (mean, [CLS] or last token), normalized.

The method comes from the model folder's sentence-transformers files when it has them (`modules.json`,
`1_Pooling/config.json`: all-MiniLM-L6-v2 says mean pooling, then Normalize), else from the model class
(`default_pooling`: "mean" for BERT) or "last" for a decoder (its last token has seen the whole input, as
vLLM's embedding runner pools decoders). Normalization (unit L2 norm) is on unless a sentence-transformers
folder leaves its Normalize module out. Truncation to fewer `dimensions` (Matryoshka) is allowed only where
the model's config declares it (`matryoshka_dimensions` / `is_matryoshka`), then renormalized.

Plain Python: the API server process reads these without importing torch; the pooling math the
worker runs is tokenloom/model/pooler.py; the struct itself is tokenloom/core/pooling.py (it crosses processes).
"""
from __future__ import annotations

import json
import math
import os

from tokenloom.config import ConfigError
from tokenloom.core.pooling import PoolingConfig

NORM_EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm

METHODS = ("mean", "cls", "last")
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def _read_json(path: str) -> dict | list | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pooling_config(model_path: str, default_method: str, hidden_size: int) -> PoolingConfig:
    method, normalize = default_method, True
    folder = model_path if os.path.isdir(model_path) else None
    matryoshka: tuple[int, ...] | bool = False
    if folder:
        modules = _read_json(os.path.join(folder, "modules.json"))
        if isinstance(modules, list) and modules:
            types = [m.get("type", "") for m in modules if isinstance(m, dict)]
            normalize = any(t.endswith("Normalize") for t in types)
            for m in modules:
                if isinstance(m, dict) and m.get("type", "").endswith("Pooling"):
                    pool = _read_json(os.path.join(folder, m.get("path", ""), "config.json")) or {}
                    chosen = [mode for key, mode in _ST_MODES.items() if pool.get(key)]
                    if chosen:
                        method = chosen[0]
        config = _read_json(os.path.join(folder, "config.json")) or {}
        if config.get("matryoshka_dimensions"):
            matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
        elif config.get("is_matryoshka"):
            matryoshka = True
    return PoolingConfig(method, normalize, hidden_size, matryoshka)


def truncate(embedding: list[float], dimensions: int | None, config: PoolingConfig) -> list[float]:
    """Matryoshka truncation to the first `dimensions` values, renormalized when the model normalizes
    (plain Python: the API server, which truncates, does not import torch)."""
    if dimensions is None or dimensions >= len(embedding):
        return embedding
    head = embedding[:dimensions]
    if not config.normalize:
        return head
    norm = max(math.sqrt(sum(v * v for v in head)), NORM_EPS)
    return [v / norm for v in head]


def pooling_for(runner: str, convert: str, model, model_path: str, hidden_size: int) -> PoolingConfig | None:
    """The pooling this engine serves, or None when it generates (vLLM's --runner / --convert rules)."""
    encoder = getattr(model, "is_encoder", False)
    if runner == "auto":
        runner = "pooling" if encoder or convert == "embed" else "generate"
    if runner == "generate":
        if encoder:
            raise ConfigError(f"{type(model).__name__} is an encoder: it embeds and cannot generate "
                              "(use --runner pooling, or leave --runner auto)")
        return None
    return pooling_config(model_path, getattr(model, "default_pooling", "last"), hidden_size)


def sentence_max_length(model_path: str) -> int | None:
    """sentence-transformers' max_seq_length (all-MiniLM-L6-v2: 256 of BERT's 512 positions), if the folder has one:
    the model was trained on inputs of at most this length, so it is the served context (as vLLM does)."""
    if not os.path.isdir(model_path):
        return None
    cfg = _read_json(os.path.join(model_path, "sentence_bert_config.json")) or {}
    value = cfg.get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None
