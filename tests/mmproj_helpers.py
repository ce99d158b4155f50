"""A tiny random LLaVA as llama.cpp users have it: its text model as a GGUF (F32, q/k rows in llama.cpp's rope
order, a tokenizer vocabulary of the folder's words) and its vision tower as an mmproj GGUF written by
scripts/make_mmproj.py."""
from __future__ import annotations

import importlib.util
import os
import re

import helpers
import numpy as np
import torch

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_mmproj.py")
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm"}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
# A Gemma 3 text model a GGUF can describe: six layers (every sixth global), local rotary base 10000, queries
# scaled by the head size.
GEMMA3_GGUF_TEXT = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                        query_pre_attn_scalar=16,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 50000.0}})
# A chat template of the kind a text GGUF carries: message content as a string (image parts arrive as text).
TEXT_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() }}: {{ message['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
UNKNOWN, CONTROL, NORMAL, BYTE = 2, 3, 1, 6
BYTE_TOKENS_FROM = 100  # past the folder's words, before its image token


def make_mmproj_module():
    spec = importlib.util.spec_from_file_location("make_mmproj", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_mmproj(folder: str, path: str, outtype: str = "f32", legacy_ffn_names: bool = False) -> str:
    return make_mmproj_module().write_mmproj(folder, path, outtype, legacy_ffn_names)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (each head's two rotary halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_llava_text_gguf(hf, folder: str, path: str, image_token: bool = True, weights: str = "F32") -> str:
    return write_text_gguf(hf, folder, path, "llama", image_token, weights)


def write_gemma3_text_gguf(hf, folder: str, path: str) -> str:
    """The Gemma 3's text model (built with GEMMA3_GGUF_TEXT) as llama.cpp's converter writes it: norms with
    the 1 added, the head tied to the embedding."""
    return write_text_gguf(hf, folder, path, "gemma3")


def write_qwen2_5_vl_text_gguf(hf, folder: str, path: str) -> str:
    """The Qwen2.5-VL's text model as llama.cpp's converter writes it: architecture qwen2vl, the M-RoPE sections
    as rope.dimension_sections."""
    return write_text_gguf(hf, folder, path, "qwen2vl")


def write_text_gguf(hf, folder: str, path: str, arch: str, image_token: bool = True, weights: str = "F32") -> str:
    """`weights`: the GGML type of the layers' 2-D weights (norms and the embedding stay F32)."""
    """The LLaVA's text model as a "llama" GGUF, with the folder tokenizer's words as the vocabulary and byte
    tokens in 256 of its filler slots (llama.cpp needs them). `image_token`: keep `<image>` in it; else that
    slot is a filler word, as in GGUFs made from the original LLaVA checkpoint."""
    import gguf
    from tokenizers import Tokenizer as HFTokenizer
    cfg = hf.config.text_config
    vocab = HFTokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab()
    words = {i: w for w, i in vocab.items()}
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if BYTE_TOKENS_FROM <= i < BYTE_TOKENS_FROM + 256:  # filler slots: SentencePiece's byte fallback
            tokens.append(f"<0x{i - BYTE_TOKENS_FROM:02X}>")
            types.append(BYTE)
            continue
        word = words.get(i, f"w{i}")
        if word == "<image>" and not image_token:
            word = f"w{i}"
        special = word.startswith("<") and word.endswith(">")
        tokens.append(word if special else "\u2581" + word)
        types.append(UNKNOWN if word == "<unk>" else CONTROL if special else NORMAL)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "qwen2vl":
        writer.add_rope_dimension_sections([*cfg.rope_parameters["mrope_section"], 0])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEXT_TEMPLATE)
    layer_names = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    for name, tensor in hf.state_dict().items():
        rest = name.removeprefix("model.").removeprefix("language_model.")
        if name == "lm_head.weight":
            if arch == "gemma3":  # tied to the embedding
                continue
            gguf_name = "output.weight"
        elif rest in _TOP:
            gguf_name = _TOP[rest]
        else:
            m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", rest)
            if m is None or "vision" in name or "visual" in name or "projector" in name:
                continue
            gguf_name = f"blk.{m[1]}.{layer_names[m[2]]}.{m[3]}"
        array = tensor.detach().float().numpy()
        if arch == "gemma3" and "norm" in gguf_name:
            array = array + 1
        elif arch == "llama" and ".attn_q." in gguf_name:
            array = _permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = _permute(array, cfg.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType[weights]
        if gguf_name.startswith("blk.") and array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

ENGINE = dict(progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)


def greedy_with_images(llm, ids: list[int], images) -> list[int]:
    """The engine's greedy tokens for a prompt's ids and its images."""
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, helpers.vlm_greedy(),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def prompt_ids(folder: str, prompt: str) -> list[int]:
    """The prompt's ids from the folder's tokenizer (the words of both tokenizers are one vocabulary)."""
    from tokenloom.tokenizer import Tokenizer
    return Tokenizer.from_folder(folder).encode(prompt)


def hf_greedy_with_pixels(hf, ids: list[int], pixels: torch.Tensor) -> list[int]:
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": pixels, "attention_mask": torch.ones(1, len(ids))}
    return helpers.hf_vlm_tokens(hf, inputs)
