"""PEFT adapter folders: `adapter_config.json` + `adapter_model.safetensors`, as `peft` saves them.

`read_peft_spec` reads the config and the safetensors header only (no tensor data, no torch), so the
EngineCore can check an adapter against the base model before any request uses it; `load_peft_adapter` reads
the tensors into a `LoRAAdapter`. Tensor names are PEFT's:
`base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`.

Refused with one line, never half-served: per-module ranks or alphas (`rank_pattern`, `alpha_pattern`),
trained biases, DoRA, aLoRA, extra trained modules (`modules_to_save`), targets other than the attention and MLP
projections, a missing or unreadable file.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from tokenloom.core.lora_request import LoRARequest
from tokenloom.lora.adapter import LORA_TARGETS, LoRAAdapter, LoRAAdapterError, LoRAWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_HEADER = 100 * 2 ** 20  # a safetensors header larger than this is a corrupt file, not an adapter


@dataclass
class PeftAdapterSpec:
    """What the files say, before any tensor is read: enough to check the adapter against a model."""

    rank: int
    alpha: float
    use_rslora: bool
    base_model_name: str | None
    shapes: dict[tuple[int, str, str], tuple[int, ...]] = field(default_factory=dict)  # (layer, target, A|B)
    names: dict[tuple[int, str, str], str] = field(default_factory=dict)  # the same keys -> tensor names

    def check_fits(self, name: str, target_shapes: dict[str, tuple[int, int]], num_layers: int,
                   max_rank: int) -> None:
        """Raise LoRAAdapterError unless every pair fits its layer: A [rank, in], B [out, rank]."""
        if self.rank > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {self.rank}, over --max-lora-rank {max_rank}")
        for (layer, target, which), shape in self.shapes.items():
            where = f"LoRA adapter {name!r}: layer {layer} {target} lora_{which}"
            if layer >= num_layers:
                raise LoRAAdapterError(f"{where}: the base model has {num_layers} layers (wrong base model?)")
            fan_in, fan_out = target_shapes[target]
            want = (self.rank, fan_in) if which == "A" else (fan_out, self.rank)
            if tuple(shape) != want:
                raise LoRAAdapterError(f"{where} is {list(shape)}, the base model needs {list(want)} "
                                       "(wrong base model?)")


def read_peft_spec(path: str | Path) -> PeftAdapterSpec:
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a folder (a PEFT adapter is a folder with "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(folder / CONFIG_FILE)
    spec = PeftAdapterSpec(rank=_int(config, "r", folder), alpha=float(config.get("lora_alpha") or 8),
                           use_rslora=bool(config.get("use_rslora", False)),
                           base_model_name=config.get("base_model_name_or_path"))
    for (name, shape) in _read_header(folder / WEIGHTS_FILE).items():
        match = _TENSOR_NAME.search(name)
        if match is None or match.group(2) not in LORA_TARGETS:
            raise LoRAAdapterError(f"{folder / WEIGHTS_FILE}: tensor {name!r} is not a LoRA A/B matrix of a "
                                   f"supported target ({', '.join(LORA_TARGETS)})")
        key = (int(match.group(1)), match.group(2), match.group(3))
        spec.shapes[key], spec.names[key] = shape, name
    pairs = {(layer, target) for layer, target, _ in spec.shapes}
    for layer, target in sorted(pairs):
        if (layer, target, "A") not in spec.shapes or (layer, target, "B") not in spec.shapes:
            raise LoRAAdapterError(f"{folder / WEIGHTS_FILE}: layer {layer} {target} lacks its lora_A or lora_B")
    if not pairs:
        raise LoRAAdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    return spec


def load_peft_adapter(lora: LoRARequest) -> LoRAAdapter:
    """The adapter's tensors as float32 [rank, in] / [out, rank] pairs."""
    spec = read_peft_spec(lora.lora_path)
    adapter = LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id, rank=spec.rank, alpha=spec.alpha,
                          use_rslora=spec.use_rslora, path=lora.lora_path,
                          base_model_name=lora.base_model_name or spec.base_model_name)
    try:
        with safe_open(str(Path(lora.lora_path) / WEIGHTS_FILE), framework="pt") as f:
            for layer, target in sorted({(layer, target) for layer, target, _ in spec.shapes}):
                a = f.get_tensor(spec.names[(layer, target, "A")]).float()
                b = f.get_tensor(spec.names[(layer, target, "B")]).float()
                adapter.weights[(layer, target)] = LoRAWeights(a, b)
    except (OSError, RuntimeError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: cannot read {WEIGHTS_FILE}: {e}") from None
    adapter.check_weights()
    return adapter


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter folder {str(path.parent)!r} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{path}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {peft_type!r} is not LoRA")
    for key, why in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                     ("modules_to_save", "extra trained modules"), ("use_dora", "DoRA"),
                     ("lora_bias", "LoRA biases"), ("alora_invocation_tokens", "activated LoRA (aLoRA)")):
        if config.get(key):
            raise LoRAAdapterError(f"{path}: {why} ({key}) are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path}: trained biases (bias={config['bias']!r}) are not supported")
    return config


def _int(config: dict, key: str, folder: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value < 1:
        raise LoRAAdapterError(f"{folder / CONFIG_FILE}: {key} must be a positive integer (got {value!r})")
    return value


def _read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors header (8-byte little-endian length, then JSON)."""
    try:
        with path.open("rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise LoRAAdapterError(f"{path}: truncated (not a safetensors file)")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > _MAX_HEADER:
                raise LoRAAdapterError(f"{path}: corrupt safetensors header")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter folder {str(path.parent)!r} has no {WEIGHTS_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path}: corrupt safetensors header")
    return {name: tuple(entry["shape"]) for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "shape" in entry}
