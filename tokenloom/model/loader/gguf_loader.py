"""Read a GGUF file: metadata, architecture, and tensors with HF names (dequantized, or repacked for the
native kernels)."""
from __future__ import annotations

import re
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, quants

from tokenloom.gguf_layout import unpermute_qk
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.quantized_weight import QuantizedWeight
from tokenloom.model.loader.gguf_repack import SUPPORTED, repack
from tokenloom.model.model_errors import CorruptModelError, UnsupportedModelError, naming_the_file, one_line

__all__ = ["CorruptModelError", "GGUFModelFile", "dense_tensor", "hf_name"]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    # Mixture of experts: the router, every expert stacked in one tensor, the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3 normalizes before and after both attention and MLP: its ffn_norm is the pre-MLP one.
_GEMMA3_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Architectures whose GGUF converter interleaves q/k rows for llama.cpp's rope; undone here.
_PERMUTED_QK = {"llama", "mistral"}


def hf_name(gguf_name: str, arch: str | None = None) -> str:
    base, _, kind = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {**_LAYER_NAMES, **_GEMMA3_LAYER_NAMES} if arch == "gemma3" else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{kind}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name!r}")


def dense_tensor(path: str, t: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float (F32/F16 as stored, quantized blocks dequantized), in torch's dimension order."""
    try:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.asarray(t.data)
        else:
            array = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(f"{path}: tensor {t.name} uses unsupported quantization "
                                    f"{t.tensor_type.name}") from None
    except Exception as exc:
        raise CorruptModelError(f"{path}: tensor {t.name} could not be read ({one_line(exc)})") from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)
    except RuntimeError as exc:
        raise CorruptModelError(f"{path}: tensor {t.name} could not be read ({one_line(exc)})") from None


class GGUFModelFile:
    """A GGUF file opened with the `gguf` package's reader (memory-mapped, copy-on-write)."""

    def __init__(self, path: str):
        self.path = path
        try:
            # Copy-on-write mapping: the arrays it hands out are writable (torch.from_numpy warns on a read-only
            # one) yet share the file's pages; a write would only touch this process's private copy of a page.
            self.reader = GGUFReader(path, mode="c")
        except Exception as exc:  # the reader raises assorted errors on a bad file
            raise CorruptModelError(f"{path}: not a readable GGUF file ({one_line(exc)})") from None
        self.metadata: dict[str, object] = {}  # GGUF values; the token list as a range of its length
        for key, field in self.reader.fields.items():
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.scores"):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:
                continue
        self.metadata["tokenizer.ggml.tokens"] = range(self._array_len("tokenizer.ggml.tokens"))
        names = {t.name for t in self.reader.tensors}
        with naming_the_file(path):
            self.arch_config = ArchConfig.from_gguf(self.metadata, names)
        self.arch = self.metadata["general.architecture"]

    def _array_len(self, key: str) -> int:
        field = self.reader.fields.get(key)
        return len(field.data) if field is not None else 0

    def tensors(self, dtype: torch.dtype, quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor; with `quantized`, 2-D weights in a type the native kernels
        multiply (gguf_repack.SUPPORTED) come as QuantizedWeight, repacked from their blocks."""
        cfg = self.arch_config
        for t in self.reader.tensors:
            if quantized and t.tensor_type.name in SUPPORTED and len(t.shape) == 2:
                yield self._repacked(t)
                continue
            tensor = dense_tensor(self.path, t)
            name = self._hf_name(t.name)
            if self.arch == "gemma3" and name.endswith("norm.weight"):
                tensor = tensor - 1  # llama.cpp's converter folds Gemma's (1 + w) into the stored weight
            if self.arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
                heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
                tensor = unpermute_qk(tensor, heads)
            yield name, tensor.to(dtype)

    def _repacked(self, t) -> tuple[str, QuantizedWeight]:
        rows, cols = int(t.shape[1]), int(t.shape[0])
        try:
            weight = repack(t.tensor_type.name, t.data, rows, cols)
        except Exception as exc:
            raise CorruptModelError(f"{self.path}: tensor {t.name} could not be read ({one_line(exc)})") from None
        name = self._hf_name(t.name)
        if self.arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = self.arch_config.num_heads if ".q_proj." in name else self.arch_config.num_kv_heads
            weight = weight.index_rows(unpermute_qk(torch.arange(rows)[:, None], heads)[:, 0])
        return name, weight

    def _hf_name(self, gguf_name: str) -> str:
        with naming_the_file(self.path):
            return hf_name(gguf_name, self.arch)

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)
