"""An mmproj file's tensors under the Hugging Face names of the same model's checkpoint.

llama.cpp's converters name the tower `v.*` and the projector `mm.*` (tools/mtmd/clip-impl.h). The tower's
names are the same for CLIP (LLaVA) and SigLIP (Gemma 3); the projector's depend on its type. Older LLaVA
converters wrote each block's fc1 as `ffn_down` and fc2 as `ffn_up`; llama.cpp tells them apart by shape, and
so does this: the tensor that reads the tower's width is fc1, whatever its name.

Tensors are dequantized to float (F16/F32 as stored, Q8_0 and other block types through the GGUF reader) and
come back in torch's dimension order; the text model's are the text GGUF's (gguf_loader).
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from gguf import GGUFReader

from tokenloom.model.loader.gguf_loader import dense_tensor
from tokenloom.model.model_errors import CorruptModelError, one_line

TOWER = "vision_tower.vision_model."
_TOP = {"v.class_embd": "embeddings.class_embedding", "v.patch_embd": "embeddings.patch_embedding",
        "v.position_embd": "embeddings.position_embedding", "v.pre_ln": "pre_layrnorm",
        "v.post_ln": "post_layernorm"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
          "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_SWAPPED_FFN = {"ffn_up": "mlp.fc2", "ffn_down": "mlp.fc1"}
# clip.projector_type -> {mmproj name: HF name} of the projector's tensors
PROJECTOR_NAMES = {
    "mlp": {"mm.0.weight": "multi_modal_projector.linear_1.weight", "mm.0.bias": "multi_modal_projector.linear_1.bias",
            "mm.2.weight": "multi_modal_projector.linear_2.weight", "mm.2.bias": "multi_modal_projector.linear_2.bias"},
    "gemma3": {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
               "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
}
_FOLDED_NORMS = {"mm.soft_emb_norm.weight"}  # llama.cpp stores Gemma's (1 + w); the model holds w


class MmprojTensors:
    def __init__(self, path: str, projector_type: str, tower_width: int):
        self.path = path
        self.projector = PROJECTOR_NAMES[projector_type]
        try:
            self.reader = GGUFReader(path, mode="c")
        except Exception as exc:  # the reader raises assorted errors on a bad file
            raise CorruptModelError(f"{path}: not a readable GGUF file ({one_line(exc)})") from None
        by_name = {t.name: t for t in self.reader.tensors}
        down = by_name.get("v.blk.0.ffn_down.weight")
        # fc2 reads the MLP's width; a file whose "ffn_down" reads the tower's width holds fc1 there.
        self.ffn_swapped = down is not None and int(down.shape[0]) == tower_width

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for t in self.reader.tensors:
            tensor = dense_tensor(self.path, t)
            if t.name in _FOLDED_NORMS:
                tensor = tensor - 1
            yield self.hf_name(t.name), tensor

    def hf_name(self, name: str) -> str:
        if name in self.projector:
            return self.projector[name]
        base, dot, kind = name.rpartition(".")
        if name in _TOP:  # a bare tensor (the CLS embedding)
            return TOWER + _TOP[name]
        if base in _TOP:
            return f"{TOWER}{_TOP[base]}.{kind}"
        block = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
        if block and block.group(2) in _BLOCK:
            names = {**_BLOCK, **_SWAPPED_FFN} if self.ffn_swapped else _BLOCK
            return f"{TOWER}encoder.layers.{block.group(1)}.{names[block.group(2)]}.{kind}"
        raise CorruptModelError(f"{self.path}: unknown mmproj tensor {name!r} for this projector type")
