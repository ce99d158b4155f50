"""Server-side sampling defaults from the model folder's generation_config.json (as vLLM applies them)."""
from __future__ import annotations

import json
import os

# generation_config.json keys that become server-side sampling defaults.
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# A default's value: a number (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens).
GenerationDefaults = dict[str, float | int]


def load_generation_defaults(model_path: str | None) -> GenerationDefaults:
    """Sampling defaults from the model folder's generation_config.json (empty for GGUF files)."""
    if not model_path or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {k: data[k] for k in _GENERATION_DEFAULT_KEYS if data.get(k) is not None}
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    if data.get("max_new_tokens") is not None:
        out["max_tokens"] = data["max_new_tokens"]
    return out
