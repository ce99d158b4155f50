"""What Ollama's model endpoints say about the served model: /api/tags, /api/show, /api/ps.

tokenloom serves one model, loaded at start-up; these describe it from what the server knows: the
weights' files (size, modification time, GGUF or safetensors), the engine's report (architecture,
context length, dtype) and the tokenizer's chat template. ``digest`` identifies the weights' files
by path, size and time (hashing gigabytes of weights for a listing would take minutes);
``parameter_size`` is read from the model's name where it carries one (``smollm2-135m``), and the
GGUF quantization from the file name (llama.cpp's naming).
"""
from __future__ import annotations

import hashlib
import os
import re
from datetime import datetime, timezone
from functools import lru_cache

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.native.ollama_translate import DEFAULT_TAG

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_PARAMETER_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([mb])(?![a-z])", re.IGNORECASE)
_GGUF_QUANT = re.compile(r"[.-]((?:I?Q\d\w*)|F16|F32|BF16)\.gguf$", re.IGNORECASE)
# Expiry reported by /api/ps: the model stays loaded while the server runs.
_NEVER = "2318-01-01T00:00:00Z"


@lru_cache(maxsize=8)
def _files(path: str) -> tuple[int, float]:
    """(total bytes, latest modification time) of the weights at `path` (a file or a folder)."""
    if os.path.isfile(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    size, mtime = 0, 0.0
    for root, _, names in os.walk(path):
        for name in names:
            if name.endswith(_WEIGHT_SUFFIXES):
                st = os.stat(os.path.join(root, name))
                size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    return size, mtime


def tagged(name: str) -> str:
    """The name as Ollama lists models: with a tag."""
    return name if ":" in name else name + DEFAULT_TAG


def family(architecture: str | None) -> str:
    """``LlamaForCausalLM`` -> ``llama``; ``Gemma3ForCausalLM`` -> ``gemma3``."""
    if not architecture:
        return "unknown"
    return re.sub(r"For(CausalLM|ConditionalGeneration|MaskedLM)$|Model$", "", architecture).lower() or "unknown"


def parameter_size(name: str) -> str:
    m = _PARAMETER_SIZE.search(name)
    return f"{m.group(1)}{m.group(2).upper()}" if m else "unknown"


def quantization_level(model_path: str, dtype: str | None) -> str:
    m = _GGUF_QUANT.search(model_path)
    if m:
        return m.group(1).upper()
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype or "", (dtype or "unknown").upper())


class OllamaModelCard:
    """The served model as /api/tags, /api/show and /api/ps list it."""

    def __init__(self, engine: AsyncLLM, names: list[str]) -> None:
        self.engine = engine
        self.names = names

    @property
    def path(self) -> str:
        return self.engine.model_path or (self.engine.info.model_path if self.engine.info else "")

    def details(self, name: str) -> JsonObject:
        info = self.engine.info
        fam = family(info.architecture if info else None)
        fmt = "gguf" if self.path.lower().endswith(".gguf") else "safetensors"
        return {"parent_model": "", "format": fmt, "family": fam, "families": [fam],
                "parameter_size": parameter_size(name),
                "quantization_level": quantization_level(self.path, info.dtype if info else None)}

    def _size_and_time(self) -> tuple[int, str]:
        size, mtime = _files(self.path) if self.path and os.path.exists(self.path) else (0, 0.0)
        return size, datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def digest(self) -> str:
        size, modified = self._size_and_time()
        return hashlib.sha256(f"{self.path}\0{size}\0{modified}".encode()).hexdigest()

    def entry(self, name: str) -> JsonObject:
        size, modified = self._size_and_time()
        return {"name": tagged(name), "model": tagged(name), "modified_at": modified, "size": size,
                "digest": self.digest(), "details": self.details(name)}

    def tags(self) -> JsonObject:
        return {"models": [self.entry(n) for n in self.names]}

    def running(self) -> JsonObject:
        on_gpu = bool(self.engine.info and self.engine.info.device.startswith("cuda"))
        models: list[JsonValue] = []
        for name in self.names:
            entry = self.entry(name)
            entry.pop("modified_at")
            models.append({**entry, "expires_at": _NEVER, "size_vram": entry["size"] if on_gpu else 0,
                           "context_length": self.engine.max_model_len})
        return {"models": models}

    def capabilities(self) -> list[JsonValue]:
        if self.engine.pooling is not None:
            return ["embedding"]
        config = self.engine.config
        template = self.template()
        caps: list[JsonValue] = ["completion"]
        if config.tool_call_parser and "tools" in template:
            caps.append("tools")
        if config.reasoning_parser:
            caps.append("thinking")
        return caps

    def template(self) -> str:
        tokenizer = self.engine.tokenizer
        return (tokenizer.chat_template or "") if tokenizer is not None else ""

    def show(self, name: str) -> JsonObject:
        info = self.engine.info
        details = self.details(name)
        fam = details["family"]
        _, modified = self._size_and_time()
        model_info: JsonObject = {"general.architecture": fam, "general.basename": name,
                                  f"{fam}.context_length": self.engine.max_model_len}
        if info is not None:
            model_info[f"{fam}.vocab_size"] = info.vocab_size
            model_info["tokenloom.architecture"] = info.architecture
            model_info["tokenloom.dtype"] = info.dtype
        return {"license": "", "modelfile": f"# served by tokenloom\nFROM {self.path}\n", "parameters": "",
                "template": self.template(), "details": details, "model_info": model_info,
                "capabilities": self.capabilities(), "modified_at": modified}
