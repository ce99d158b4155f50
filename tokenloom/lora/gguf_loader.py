"""llama.cpp's GGUF LoRA files (as `convert_lora_to_gguf.py` writes them) into a `LoRAAdapter`.

The file says it is an adapter by its metadata: `general.type` "adapter", `adapter.type` "lora", and the
scaling's numerator in `adapter.lora.alpha` (llama.cpp scales by alpha / rank, the rank read from the
tensors). Each trained projection is a pair `blk.{i}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|
ffn_down}.weight.lora_a` / `.lora_b`, GGML dims [in, rank] and [rank, out]: row-major [rank, in] and
[out, rank], PEFT's own layout, in F32, F16, BF16 or Q8_0 (dequantized to float32 here).

For Llama and Mistral, llama.cpp's converter permutes the rows of the q and k projections (it interleaves the
two rotary halves of each head) and applies the same permutation to their LoRA B; the base GGUF loader undoes
it for the weights (tokenloom/model/loader/gguf_loader.py), so the B rows are put back here the same way,
which needs the base model's head counts. The file carries neither those nor rsLoRA: its alpha is used as is.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from tokenloom.core.lora_request import LoRARequest
from tokenloom.gguf_layout import unpermute_qk
from tokenloom.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights
from tokenloom.lora.peft_loader import PeftAdapterSpec

GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_TENSOR_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# The architectures whose q/k rows llama.cpp's converter reorders (the base loader's list: tokenloom/model/loader/
# gguf_loader.py; this package sits below tokenloom.model, so it keeps its own).
PERMUTED_QK_ARCHS = {"llama", "mistral"}
_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0}


def is_gguf_lora(path: str | Path) -> bool:
    """Whether the path is a file that starts as a GGUF file does (PEFT adapters are folders)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf_lora_spec(path: str | Path) -> PeftAdapterSpec:
    """Rank, alpha and every pair's shape, from the file's metadata and tensor index (the data stays mapped,
    unread), in the same form as a PEFT folder's so the engine checks both the same way."""
    reader = _open(path)
    spec = PeftAdapterSpec(rank=0, alpha=0.0, use_rslora=False, base_model_name=_string(reader, "general.name"))
    for t in reader.tensors:
        key = _key(path, t.name)
        spec.shapes[key] = tuple(int(d) for d in reversed(t.shape.tolist()))
        spec.names[key] = t.name
        if t.tensor_type not in _TYPES:
            raise LoRAAdapterError(f"{path}: tensor {t.name} is {t.tensor_type.name} (supported: "
                                   f"{', '.join(sorted(q.name for q in _TYPES))})")
    pairs = sorted({(layer, target) for layer, target, _ in spec.shapes})
    if not pairs:
        raise LoRAAdapterError(f"{path} holds no LoRA weights")
    for layer, target in pairs:
        if (layer, target, "A") not in spec.shapes or (layer, target, "B") not in spec.shapes:
            raise LoRAAdapterError(f"{path}: layer {layer} {target} lacks its lora_a or lora_b")
    ranks = {spec.shapes[(layer, target, "A")][0] for layer, target in pairs}
    if len(ranks) != 1:
        raise LoRAAdapterError(f"{path}: the pairs differ in rank ({sorted(ranks)}); one rank an adapter is served")
    spec.rank = ranks.pop()
    alpha = _field(reader, "adapter.lora.alpha")
    spec.alpha = float(alpha) if alpha is not None and float(alpha) > 0 else float(spec.rank)  # llama.cpp: 0 = none
    return spec


def load_gguf_lora_adapter(lora: LoRARequest, num_heads: int | None = None,
                           num_kv_heads: int | None = None) -> LoRAAdapter:
    """The adapter's pairs as float32 [rank, in] / [out, rank], q and k B rows in the base loader's order.
    `num_heads` / `num_kv_heads`: the base model's, needed for a Llama or Mistral file that trains q or k."""
    spec = read_gguf_lora_spec(lora.lora_path)
    reader = _open(lora.lora_path)
    arch = _string(reader, "general.architecture") or ""
    tensors = {t.name: t for t in reader.tensors}
    adapter = LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id, rank=spec.rank, alpha=spec.alpha,
                          path=lora.lora_path, base_model_name=lora.base_model_name or spec.base_model_name)
    for layer, target in sorted({(layer, target) for layer, target, _ in spec.shapes}):
        a = _tensor(lora.lora_path, tensors[spec.names[(layer, target, "A")]])
        b = _tensor(lora.lora_path, tensors[spec.names[(layer, target, "B")]])
        if arch in PERMUTED_QK_ARCHS and target in ("q_proj", "k_proj"):
            heads = num_heads if target == "q_proj" else num_kv_heads
            if heads is None:
                raise LoRAAdapterError(f"{lora.lora_path}: a {arch} file's {target} rows need the base model's "
                                       "head count")
            b = unpermute_qk(b, heads)
        adapter.weights[(layer, target)] = LoRAWeights(a, b)
    adapter.check_weights()
    return adapter


def _open(path: str | Path) -> GGUFReader:
    try:
        reader = GGUFReader(str(path), "r")
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter file {str(path)!r} does not exist") from None
    except Exception as exc:  # the gguf package raises ValueError, struct.error, IndexError... on a bad file
        raise LoRAAdapterError(f"{path}: not a readable GGUF file ({exc})") from None
    kind, adapter_type = _string(reader, "general.type"), _string(reader, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise LoRAAdapterError(f"{path}: a GGUF file but not a LoRA adapter (general.type {kind!r}, adapter.type "
                               f"{adapter_type!r}; a LoRA file has 'adapter' and 'lora')")
    return reader


def _key(path: str | Path, name: str) -> tuple[int, str, str]:
    match = _TENSOR_NAME.match(name)
    if match is None or match.group(2) not in GGUF_TARGETS:
        raise LoRAAdapterError(f"{path}: tensor {name!r} is not a LoRA pair of a supported target "
                               f"({', '.join(GGUF_TARGETS)})")
    return int(match.group(1)), GGUF_TARGETS[match.group(2)], match.group(3).upper()


def _tensor(path: str | Path, t) -> torch.Tensor:
    try:
        array = np.asarray(t.data) if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) \
            else quants.dequantize(t.data, t.tensor_type)
    except Exception as exc:
        raise LoRAAdapterError(f"{path}: tensor {t.name} could not be read ({exc})") from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)


def _field(reader: GGUFReader, key: str) -> str | float | int | None:
    field = reader.get_field(key)
    return field.contents() if field is not None else None


def _string(reader: GGUFReader, key: str) -> str | None:
    value = _field(reader, key)
    return value if isinstance(value, str) else None
