"""Write a llama.cpp `mmproj` GGUF from a Hugging Face LLaVA, Gemma 3 or Qwen2.5-VL folder: the vision tower and
projector with the `clip.*` metadata, in the layout llama.cpp's converters produce (tools/mtmd/clip-impl.h).

    python scripts/make_mmproj.py path/to/llava-1.5-7b-hf mmproj.gguf [--outtype f16]

LLaVA (projector type `mlp`): the tower up to the deepest layer the projector reads (post-norm dropped),
`clip.vision.feature_layer` as non-negative hidden-state indices, `mm.0`/`mm.2` for the projector's two linears,
`clip.use_gelu` when the tower's activation is GELU (else llama.cpp's quick GELU). Gemma 3 (`gemma3`): the whole
SigLIP tower with its post-norm, `mm.input_projection.weight` and `mm.soft_emb_norm.weight` stored with Gemma's 1
added, `clip.vision.projector.scale_factor` when the pooling is not the released 4x4. Qwen2.5-VL
(`qwen2.5vl_merger`): the patch convolution as two frames (`v.patch_embd.weight`, `.weight.1`), qkv split into q, k
and v, the merger as `v.post_ln`, `mm.0`, `mm.2`, `clip.vision.n_wa_pattern` from the full-attention blocks, the
window and merge size when not the released 112 and 2, the preprocessor's pixel bounds as
`clip.vision.image_min_pixels`/`image_max_pixels`. The image size, patch size, mean and std come from config.json
and preprocessor_config.json. 1-D tensors and the position embedding stay F32, the patch embedding F32 (F16 for
--outtype f16), as llama.cpp keeps them; with q8_0 the 2-D weights whose rows are multiples of 32 are Q8_0 (Gemma
3's input projection F16).

tokenloom's tests write the tiny models' mmproj files with this (tests/mmproj_helpers.py).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_TOP = {"embeddings.class_embedding": "v.class_embd", "embeddings.patch_embedding": "v.patch_embd",
        "embeddings.position_embedding": "v.position_embd", "pre_layrnorm": "v.pre_ln",
        "post_layernorm": "v.post_ln"}
_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
          "mlp.fc2": "ffn_down"}
_PROJECTOR = {"linear_1": "mm.0", "linear_2": "mm.2", "mm_input_projection_weight": "mm.input_projection.weight",
              "mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight"}


def tower_name(inner: str) -> str | None:
    """The mmproj name of a tower tensor named `inner` below `vision_model.`."""
    base, _, kind = inner.rpartition(".")
    if inner in _TOP:
        return _TOP[inner]
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", base)
    if m and m.group(2) in _BLOCK:
        return f"v.blk.{m.group(1)}.{_BLOCK[m.group(2)]}.{kind}"
    return None


_QWEN_BLOCK = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QWEN_TOP = {"merger.ln_q.weight": "v.post_ln.weight", "merger.mlp.0.weight": "mm.0.weight",
             "merger.mlp.0.bias": "mm.0.bias", "merger.mlp.2.weight": "mm.2.weight", "merger.mlp.2.bias": "mm.2.bias"}


def qwen_tensors(inner: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen2.5-VL's tower tensor `inner` (below `visual.`) as llama.cpp's converter writes it: the patch
    convolution split into its two frames, the fused qkv into q, k and v."""
    if inner == "patch_embed.proj.weight":
        yield "v.patch_embd.weight", tensor[:, :, 0]
        yield "v.patch_embd.weight.1", tensor[:, :, 1]
        return
    if inner in _QWEN_TOP:
        yield _QWEN_TOP[inner], tensor
        return
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", inner)
    if m and m.group(2) == "attn.qkv":
        for part, piece in zip(("attn_q", "attn_k", "attn_v"), tensor.chunk(3, dim=0)):
            yield f"v.blk.{m.group(1)}.{part}.{m.group(3)}", piece
    elif m and m.group(2) in _QWEN_BLOCK:
        yield f"v.blk.{m.group(1)}.{_QWEN_BLOCK[m.group(2)]}.{m.group(3)}", tensor
    else:
        raise SystemExit(f"unknown Qwen2.5-VL vision tensor {inner}")


def split_checkpoint(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """("tower" | "projector" | "qwen", name inside it, tensor) for the vision tensors, in either checkpoint
    layout."""
    for name, tensor in tensors.items():
        rest = name.removeprefix("model.")
        if rest.startswith("visual."):
            yield "qwen", rest.removeprefix("visual."), tensor
        elif rest.startswith("vision_tower."):
            yield "tower", rest.removeprefix("vision_tower.").removeprefix("vision_model."), tensor
        elif rest.startswith("multi_modal_projector."):
            yield "projector", rest.removeprefix("multi_modal_projector."), tensor


def projector_name(inner: str) -> str:
    if inner in _PROJECTOR:
        return _PROJECTOR[inner]
    base, _, kind = inner.rpartition(".")
    return f"{_PROJECTOR[base]}.{kind}"


def write_mmproj(folder: str, out: str, outtype: str = "f32", legacy_ffn_names: bool = False) -> str:
    """`legacy_ffn_names`: fc1 as `ffn_down` and fc2 as `ffn_up`, as llama.cpp's older LLaVA converter wrote
    them (readers tell the two apart by shape)."""
    root = Path(folder)
    config = json.loads((root / "config.json").read_text())
    pre_path = root / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
    arch = config["architectures"][0]
    vision, text = dict(config["vision_config"]), config.get("text_config") or config
    if arch == "Qwen2_5_VLForConditionalGeneration":  # the converter's spellings of Qwen's sizes
        vision.update(image_size=vision.get("image_size", 560), num_attention_heads=vision["num_heads"],
                      num_hidden_layers=vision["depth"])
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    writer = gguf.GGUFWriter(out, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
                         if outtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_uint32("clip.vision.projection_dim", text.get("hidden_size", 4096))
    writer.add_array("clip.vision.image_mean", [float(v) for v in pre.get("image_mean", CLIP_MEAN)])
    writer.add_array("clip.vision.image_std", [float(v) for v in pre.get("image_std", CLIP_STD)])
    if arch == "LlavaForConditionalGeneration":
        keep_layers = _llava_metadata(writer, config, vision)
    elif arch == "Gemma3ForConditionalGeneration":
        keep_layers = _gemma3_metadata(writer, config, vision)
    elif arch == "Qwen2_5_VLForConditionalGeneration":
        keep_layers = _qwen2_5_vl_metadata(writer, vision, pre)
    else:
        raise SystemExit(f"{folder}: {arch} is not LLaVA, Gemma 3 or Qwen2.5-VL")
    for part, inner, tensor in split_checkpoint(tensors):
        if part == "qwen":
            for name, piece in qwen_tensors(inner, tensor):
                _add(writer, name, piece.float().contiguous().numpy(), outtype)
            continue
        if part == "tower":
            name = tower_name(inner)
            layer = re.match(r"v\.blk\.(\d+)\.", name or "")
            if name is None or (layer and int(layer.group(1)) >= keep_layers) or \
                    (name.startswith("v.post_ln") and arch == "LlavaForConditionalGeneration"):
                continue
            if legacy_ffn_names and ".ffn_" in name:
                name = name.replace(".ffn_up.", ".ffn_tmp.").replace(".ffn_down.", ".ffn_up.").replace(
                    ".ffn_tmp.", ".ffn_down.")
        else:
            name = projector_name(inner)
        data = tensor.float()
        if name == "mm.soft_emb_norm.weight":
            data = data + 1  # llama.cpp stores Gemma's RMSNorm scale with its 1 added
        _add(writer, name, data.numpy(), outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llava_metadata(writer: gguf.GGUFWriter, config: dict, vision: dict) -> int:
    """LLaVA's keys; returns how many tower layers the file keeps (up to the deepest one read)."""
    layers = config.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    total = vision["num_hidden_layers"]
    layers = [i if i >= 0 else total + 1 + i for i in layers]
    if config.get("vision_feature_select_strategy", "default") != "default":
        raise SystemExit("llama.cpp's LLaVA projector drops the CLS row: only the 'default' strategy converts")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_uint32("clip.vision.block_count", max(layers))
    writer.add_array("clip.vision.feature_layer", layers)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-5))
    writer.add_bool("clip.use_gelu", vision.get("hidden_act", "quick_gelu") == "gelu")
    return max(layers)


def _gemma3_metadata(writer: gguf.GGUFWriter, config: dict, vision: dict) -> int:
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    writer.add_bool("clip.use_gelu", True)
    side = math.isqrt(config.get("mm_tokens_per_image", 256))
    scale = vision["image_size"] // vision["patch_size"] // side
    if scale != 4:
        writer.add_uint32("clip.vision.projector.scale_factor", scale)
    return vision["num_hidden_layers"]


def _qwen2_5_vl_metadata(writer: gguf.GGUFWriter, vision: dict, pre: dict) -> int:
    full = vision.get("fullatt_block_indexes", [7, 15, 23, 31])
    pattern = full[0] + 1
    if any(b - a != pattern for a, b in zip(full, full[1:])):
        raise SystemExit(f"fullatt_block_indexes {full} are not every n-th block")
    writer.add_string("clip.projector_type", "qwen2.5vl_merger")
    writer.add_uint32("clip.vision.block_count", vision["depth"])
    writer.add_uint32("clip.vision.n_wa_pattern", pattern)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_bool("clip.use_silu", True)
    if vision.get("window_size", 112) != 112:  # llama.cpp assumes 112
        writer.add_uint32("clip.vision.window_size", vision["window_size"])
    if vision.get("spatial_merge_size", 2) != 2:
        writer.add_uint32("clip.vision.spatial_merge_size", vision["spatial_merge_size"])
    for key in ("min_pixels", "max_pixels"):
        if key in pre:
            writer.add_uint32(f"clip.vision.image_{key}", pre[key])
    return vision["depth"]


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, outtype: str) -> None:
    if name == "v.position_embd.weight":  # added to the patches, which are F32 (llama.cpp keeps it F32)
        outtype = "f32"
    elif name == "mm.input_projection.weight" and outtype == "q8_0":  # llama.cpp's converter forces F16
        outtype = "f16"
    if data.ndim != 2 or outtype == "f32":
        dtype = np.float16 if outtype == "f16" and data.ndim == 4 else np.float32
        writer.add_tensor(name, np.ascontiguousarray(data.astype(dtype)))
    elif outtype == "f16":
        writer.add_tensor(name, np.ascontiguousarray(data.astype(np.float16)))
    elif data.shape[1] % 32 == 0:
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), q8), raw_dtype=q8)
    else:
        writer.add_tensor(name, np.ascontiguousarray(data.astype(np.float32)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a Hugging Face LLaVA, Gemma 3 or Qwen2.5-VL folder (config.json, "
                                   "*.safetensors)")
    ap.add_argument("out", help="the mmproj GGUF to write")
    ap.add_argument("--outtype", choices=("f32", "f16", "q8_0"), default="f16")
    ap.add_argument("--legacy-ffn-names", action="store_true",
                    help="name fc1 ffn_down and fc2 ffn_up, as llama.cpp's older LLaVA converter did")
    args = ap.parse_args(argv)
    print(write_mmproj(args.folder, args.out, args.outtype, args.legacy_ffn_names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
