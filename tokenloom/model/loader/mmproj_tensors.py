"""An mmproj file's tensors under the Hugging Face names of the same model's checkpoint.

llama.cpp's converters name the tower `v.*` and the projector `mm.*` (tools/mtmd/clip-impl.h). CLIP (LLaVA)
and SigLIP (Gemma 3) share one naming; Qwen2.5-VL's tower is named the same way but was reshaped on the way
in: its fused qkv projection split into `attn_q`/`attn_k`/`attn_v` and its two-frame patch convolution into
`v.patch_embd.weight` and `v.patch_embd.weight.1`, which are joined back here. Older converters wrote each
block's first MLP matrix as `ffn_down` and the last as `ffn_up`; llama.cpp tells them apart by shape, and so
does this: the `ffn_down` that reads the tower's width is the first.

Tensors are dequantized to float (F16/F32 as stored, Q8_0 and other block types through the GGUF reader) and
come back in torch's dimension order; the text model's are the text GGUF's (gguf_loader).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from gguf import GGUFReader

from tokenloom.model.loader.gguf_loader import dense_tensor
from tokenloom.model.model_errors import CorruptModelError, one_line


@dataclass(frozen=True)
class TowerNames:
    prefix: str  # the tower's checkpoint prefix
    top: dict[str, str]  # mmproj name (without .weight/.bias) -> name below the prefix
    blocks: str  # the block list below the prefix
    block: dict[str, str]  # mmproj block tensor -> name inside a block
    first_ffn: str  # the MLP matrix that reads the tower's width, and the last one
    last_ffn: str
    projector: dict[str, str]  # mmproj name -> checkpoint name, in full


_CLIP = TowerNames(
    prefix="vision_tower.vision_model.",
    top={"v.class_embd": "embeddings.class_embedding", "v.patch_embd": "embeddings.patch_embedding",
         "v.position_embd": "embeddings.position_embedding", "v.pre_ln": "pre_layrnorm", "v.post_ln": "post_layernorm"},
    blocks="encoder.layers", block={"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                                    "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                                    "ln1": "layer_norm1", "ln2": "layer_norm2"},
    first_ffn="mlp.fc1", last_ffn="mlp.fc2", projector={})
TOWERS = {
    "mlp": replace(_CLIP, projector={
        "mm.0.weight": "multi_modal_projector.linear_1.weight", "mm.0.bias": "multi_modal_projector.linear_1.bias",
        "mm.2.weight": "multi_modal_projector.linear_2.weight", "mm.2.bias": "multi_modal_projector.linear_2.bias"}),
    "gemma3": replace(_CLIP, projector={
        "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
        "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"}),
    "qwen2.5vl_merger": TowerNames(
        prefix="visual.", top={"v.post_ln": "merger.ln_q"}, blocks="blocks",
        block={"attn_q": "attn.qkv", "attn_k": "attn.qkv", "attn_v": "attn.qkv", "attn_out": "attn.proj",
               "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj"},
        first_ffn="mlp.up_proj", last_ffn="mlp.down_proj",
        projector={"mm.0.weight": "visual.merger.mlp.0.weight", "mm.0.bias": "visual.merger.mlp.0.bias",
                   "mm.2.weight": "visual.merger.mlp.2.weight", "mm.2.bias": "visual.merger.mlp.2.bias"}),
}
_FOLDED_NORMS = {"mm.soft_emb_norm.weight"}  # llama.cpp stores Gemma's (1 + w); the model holds w
# Tensors the converter split, and the part each is.
_QKV = {"attn_q": 0, "attn_k": 1, "attn_v": 2}
_PATCH_FRAMES = {"v.patch_embd.weight": 0, "v.patch_embd.weight.1": 1}


class MmprojTensors:
    def __init__(self, path: str, projector_type: str, tower_width: int):
        self.path = path
        self.names = TOWERS[projector_type]
        self.split_patch = projector_type == "qwen2.5vl_merger"
        try:
            self.reader = GGUFReader(path, mode="c")
        except Exception as exc:  # the reader raises assorted errors on a bad file
            raise CorruptModelError(f"{path}: not a readable GGUF file ({one_line(exc)})") from None
        by_name = {t.name: t for t in self.reader.tensors}
        down = by_name.get("v.blk.0.ffn_down.weight")
        # The last MLP matrix reads the MLP's width; a file whose "ffn_down" reads the tower's holds the first.
        swapped = down is not None and int(down.shape[0]) == tower_width
        first, last = self.names.first_ffn, self.names.last_ffn
        self.ffn = {"ffn_up": last, "ffn_down": first} if swapped else {"ffn_up": first, "ffn_down": last}

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for t in self.reader.tensors:
            tensor = dense_tensor(self.path, t)
            if t.name in _FOLDED_NORMS:
                tensor = tensor - 1
            name, part, parts, dim = self.hf_name(t.name)
            if parts == 1:
                yield name, tensor
                continue
            pending.setdefault(name, {})[part] = tensor
            if len(pending[name]) == parts:
                pieces = pending.pop(name)
                yield name, torch.stack([pieces[i] for i in range(parts)], dim) if dim == 2 else \
                    torch.cat([pieces[i] for i in range(parts)], dim)
        if pending:
            raise CorruptModelError(f"{self.path}: {', '.join(pending)} lacks some of its parts")

    def hf_name(self, name: str) -> tuple[str, int, int, int]:
        """(checkpoint name, part, parts, dim): a tensor split in the file is one part of `parts`, joined along
        `dim` (2: the patch convolution's frames, stacked; 0: q, k, v rows, concatenated)."""
        names = self.names
        if name in names.projector:
            return names.projector[name], 0, 1, 0
        if self.split_patch and name in _PATCH_FRAMES:
            return f"{names.prefix}patch_embed.proj.weight", _PATCH_FRAMES[name], 2, 2
        base, _, kind = name.rpartition(".")
        if name in names.top:  # a bare tensor (the CLS embedding)
            return names.prefix + names.top[name], 0, 1, 0
        if base in names.top:
            return f"{names.prefix}{names.top[base]}.{kind}", 0, 1, 0
        block = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
        inner = block and ({**names.block, **self.ffn}).get(block.group(2))
        if inner:
            full = f"{names.prefix}{names.blocks}.{block.group(1)}.{inner}.{kind}"
            if inner.endswith(".qkv"):
                return full, _QKV[block.group(2)], 3, 0
            return full, 0, 1, 0
        raise CorruptModelError(f"{self.path}: unknown mmproj tensor {name!r} for this projector type")
