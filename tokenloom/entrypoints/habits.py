"""What people type from habit with other tools, answered the tokenloom way.

* Ollama's `run`, `pull` and `list` are not tokenloom commands; each gets one line saying what does the
  same here, instead of argparse's list of choices.
* A misspelt flag (`--max-model-length`) names the nearest real one ("did you mean --max-model-len?").
* llama.cpp's `-ngl N` that covers every layer means "all on the GPU" (`--device cuda`), `-ngl 0` the CPU;
  only a real partial offload is refused.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Iterable

from tokenloom.config import EMBEDDED_MODEL, ConfigError
from tokenloom.model.model_path import EMBEDDING_MODEL, GEMMA3_MODEL, ModelNotFoundError, resolve_model_path

INSTALLED_MODELS = (EMBEDDED_MODEL, GEMMA3_MODEL, EMBEDDING_MODEL)
# How alike a typed flag and a real one must be (difflib's ratio) to be suggested: 0.75 takes
# --max-model-length for --max-model-len (0.91) and --temprature for --temperature (0.96), and leaves
# --foo without a guess (its best, --top, is 0.60).
FLAG_SIMILARITY = 0.75


def ollama_answer(command: str, args: list[str]) -> str | None:
    """The tokenloom way to do Ollama's `command`, or None when `command` is not one of Ollama's."""
    model = next((a for a in args if not a.startswith("-")), None) or "MODEL"
    if command == "run":
        return (f"`run` is Ollama's; here `tokenloom chat -m {model}` talks in the terminal, "
                f"`tokenloom generate -m {model} \"PROMPT\"` answers one prompt, `tokenloom serve {model}` serves it")
    if command == "pull":
        return (f"tokenloom never downloads models: give a local GGUF file or model folder with -m "
                f"(installed: {', '.join(INSTALLED_MODELS)}; `tokenloom list` shows them)")
    return None


def installed_models() -> list[str]:
    """`tokenloom list`: each installed model's name and file, and where the others come from."""
    lines = []
    for name in INSTALLED_MODELS:
        try:
            lines.append(f"{name:24} {resolve_model_path(name)}")
        except ModelNotFoundError as exc:
            lines.append(f"{name:24} not installed ({exc})")
    lines.append("Any local GGUF file or Hugging Face style folder is a model too: -m PATH "
                 "(models are never downloaded).")
    return lines


def nearest_flag(typed: str, known: Iterable[str]) -> str | None:
    """The known flag most like `typed` (its `=value` dropped), if one is alike enough."""
    flag = typed.split("=", 1)[0]
    long_flags = [k for k in known if k.startswith("--")]
    match = difflib.get_close_matches(flag, long_flags, n=1, cutoff=FLAG_SIMILARITY)
    return match[0] if match else None


def unknown_flag_hint(message: str, known: Iterable[str]) -> str:
    """argparse's "unrecognized arguments: ..." message, with "did you mean ...?" naming the nearest flag
    of each misspelt one."""
    known = list(known)
    guesses = [g for g in (nearest_flag(w, known) for w in message.partition(":")[2].split() if w.startswith("--"))
               if g]
    return f"{message}; did you mean {' or '.join(guesses)}?" if guesses else message


# llama.cpp's -ngl values that mean "every layer" whatever the model: -1 (recent builds) and the 99/999 its
# documentation uses.
ALL_LAYERS = -1


def gpu_layers_device(gpu_layers: int, model: str | None, device: str | None) -> str | None:
    """The --device that llama.cpp's `-ngl N` asks for: cuda when N covers every layer (or is -1), cpu for 0;
    a ConfigError for a real partial offload, which tokenloom does not do. None: keep --device."""
    if gpu_layers == 0:
        if device and device.startswith("cuda"):
            raise ConfigError(f"-ngl 0 keeps every layer on the CPU, but --device is {device}")
        return "cpu"
    layers = model_layers(model)
    if gpu_layers != ALL_LAYERS and gpu_layers < layers:
        raise ConfigError(f"-ngl {gpu_layers}: partial GPU offload ({gpu_layers} of the model's {layers} layers) "
                          f"is not supported; -ngl {layers} (or more, or --device cuda) puts every layer on the GPU, "
                          f"-ngl 0 none")
    if device == "cpu":
        raise ConfigError(f"-ngl {gpu_layers} puts every layer on the GPU, but --device is cpu")
    return None if device and device.startswith("cuda") else "cuda"


def model_layers(model: str | None) -> int:
    """How many transformer layers `model` has, read from its config.json or GGUF header without loading
    it (the API process imports no torch)."""
    return _layers_in(resolve_model_path(model))


@functools.lru_cache(maxsize=8)
def _layers_in(path: str) -> int:
    """gguf's reader parses the whole header, token list included: ~2 s of CPU for the embedded model's
    49,152 tokens, so a file is read once."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
        return int(layers or 0)
    from gguf import GGUFReader  # lazy: only -ngl reads a GGUF header here (numpy and gguf: CLI start-up time)
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.block_count")
    return int(field.contents()) if field is not None else 0
