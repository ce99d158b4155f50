"""A model that cannot load says so in one line naming the file and the reason, never with a KeyError or a
traceback: an unsupported architecture (listing the supported ones), a config or GGUF header that lacks a
size, unreadable or missing weights, a tensor the config does not describe, a GGUF tensor type or name the
loader does not know.

Each case is a tiny folder or GGUF file written here (a 1-layer Llama of width 8), so the errors come from
the loader reading real files. `tokenloom serve` reports the same line (tests/e2e/test_serve_startup_errors.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokenloom.entrypoints.llm import LLM
from tokenloom.model.loader import load_model, read_arch_config
from tokenloom.model.model_errors import CorruptModelError, ModelFileError, UnsupportedModelError

HIDDEN, FFN, HEADS, VOCAB = 8, 16, 2, 32
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
                "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
                "num_key_value_heads": HEADS, "max_position_embeddings": 64, "tie_word_embeddings": True}


def llama_tensors() -> dict[str, torch.Tensor]:
    layer = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              layer + "input_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.weight": (HIDDEN,),
              layer + "mlp.gate_proj.weight": (FFN, HIDDEN), layer + "mlp.up_proj.weight": (FFN, HIDDEN),
              layer + "mlp.down_proj.weight": (HIDDEN, FFN)}
    shapes.update({f"{layer}self_attn.{p}_proj.weight": (HIDDEN, HIDDEN) for p in "qkvo"})
    return {name: torch.full(shape, 0.01) for name, shape in shapes.items()}


def write_folder(folder: Path, config: dict | str | None = None,
                 tensors: dict[str, torch.Tensor] | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(LLAMA_CONFIG if config is None else config)
    (folder / "config.json").write_text(text)
    save_file(llama_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
    return str(folder)


def load(path: str) -> None:
    load_model(path, torch.float32, torch.device("cpu"), progress=False)


def assert_one_line_naming(exc: pytest.ExceptionInfo, path: str, *mentions: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert path in message, message
    for text in mentions:
        assert text in message, message


def test_the_tiny_folder_itself_loads(tmp_path):
    """The cases below break one thing of this folder: the folder as written must load."""
    load(write_folder(tmp_path / "ok"))


# --- Hugging Face folders -------------------------------------------------------------------------------

def test_an_unsupported_architecture_is_named_with_the_supported_ones_by_the_offline_llm(tmp_path):
    """A multimodal folder (no text sizes at the top of its config) names its class, not a missing key."""
    folder = write_folder(tmp_path / "idefics3", {"architectures": ["Idefics3ForConditionalGeneration"],
                                                  "text_config": {"hidden_size": HIDDEN}, "vision_config": {}})
    with pytest.raises(UnsupportedModelError) as exc:
        LLM(folder, progress=False, device="cpu", num_blocks=8)
    assert_one_line_naming(exc, str(Path(folder) / "config.json"), "'Idefics3ForConditionalGeneration'",
                           "supported: ", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_a_config_without_a_size_names_the_missing_keys(tmp_path):
    config = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("num_attention_heads", "vocab_size")}
    folder = write_folder(tmp_path / "m", config)
    with pytest.raises(CorruptModelError) as exc:
        read_arch_config(folder)
    assert_one_line_naming(exc, "config.json", folder, "'vocab_size'", "'num_attention_heads'")


def test_a_config_with_a_size_of_the_wrong_type_names_the_config(tmp_path):
    folder = write_folder(tmp_path / "m", {**LLAMA_CONFIG, "hidden_size": "eight"})
    with pytest.raises(CorruptModelError) as exc:
        read_arch_config(folder)
    assert_one_line_naming(exc, str(Path(folder) / "config.json"))


def test_a_config_that_is_not_json_names_the_file(tmp_path):
    folder = write_folder(tmp_path / "m", '{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(CorruptModelError) as exc:
        read_arch_config(folder)
    assert_one_line_naming(exc, str(Path(folder) / "config.json"), "not valid JSON")


def test_a_config_that_names_no_architecture_says_so(tmp_path):
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "architectures"}
    folder = write_folder(tmp_path / "m", config)
    with pytest.raises(UnsupportedModelError) as exc:
        read_arch_config(folder)
    assert_one_line_naming(exc, str(Path(folder) / "config.json"), "'architectures'")


def test_a_folder_without_safetensors_weights_names_the_folder(tmp_path):
    folder = write_folder(tmp_path / "m")
    (Path(folder) / "model.safetensors").rename(Path(folder) / "pytorch_model.bin")
    with pytest.raises(CorruptModelError) as exc:
        load(folder)
    assert_one_line_naming(exc, folder, "no *.safetensors")


def test_a_cut_safetensors_file_names_the_file(tmp_path):
    folder = write_folder(tmp_path / "m")
    weights = Path(folder) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptModelError) as exc:
        load(folder)
    assert_one_line_naming(exc, str(weights), "not a readable safetensors file")


def test_a_tensor_whose_shape_the_config_does_not_give_names_the_tensor(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(FFN + 4, HIDDEN)
    folder = write_folder(tmp_path / "m", tensors=tensors)
    with pytest.raises(CorruptModelError) as exc:
        load(folder)
    assert_one_line_naming(exc, folder, "model.layers.0.mlp.up_proj.weight", f"({FFN + 4}, {HIDDEN})")


def test_a_missing_tensor_names_it(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    folder = write_folder(tmp_path / "m", tensors=tensors)
    with pytest.raises(CorruptModelError) as exc:
        load(folder)
    assert_one_line_naming(exc, folder, "model.layers.0.self_attn.k_proj.weight")


def test_a_tensor_with_no_place_in_the_model_names_the_file_and_tensor(tmp_path):
    folder = write_folder(tmp_path / "m", tensors={**llama_tensors(), "model.vision_tower.weight": torch.zeros(2)})
    with pytest.raises(UnsupportedModelError) as exc:
        load(folder)
    assert_one_line_naming(exc, folder, "model.vision_tower.weight")


# --- GGUF files -----------------------------------------------------------------------------------------

def write_gguf(path: Path, arch: str = "llama", skip_metadata: str | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> str:
    """A 1-layer GGUF of `arch` with llama.cpp's names (tied output), float32 unless a tensor says otherwise."""
    writer = gguf.GGUFWriter(str(path), arch)
    metadata = {"block_count": writer.add_block_count, "embedding_length": writer.add_embedding_length,
                "attention.head_count": writer.add_head_count}
    for key, add in metadata.items():
        if key != skip_metadata:
            add({"block_count": 1, "embedding_length": HIDDEN, "attention.head_count": HEADS}[key])
    writer.add_feed_forward_length(FFN)
    writer.add_context_length(64)
    writer.add_vocab_size(VOCAB)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    shapes.update({f"blk.0.attn_{p}.weight": (HIDDEN, HIDDEN) for p in ("q", "k", "v", "output")})
    tensors = {name: np.full(shape, 0.01, dtype=np.float32) for name, shape in shapes.items()}
    for name, array in {**tensors, **(extra_tensors or {})}.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_tiny_gguf_itself_loads(tmp_path):
    load(write_gguf(tmp_path / "ok.gguf"))


def test_a_gguf_of_an_unknown_architecture_names_the_file_and_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError) as exc:
        load(path)
    assert_one_line_naming(exc, path, "'gpt2'", "supported: llama")


def test_a_gguf_without_a_size_in_its_metadata_names_the_key(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", skip_metadata="attention.head_count")
    with pytest.raises(CorruptModelError) as exc:
        read_arch_config(path)
    assert_one_line_naming(exc, path, "llama.attention.head_count")


def test_a_gguf_tensor_type_the_loader_cannot_read_names_the_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.attn_norm.bias": np.zeros(HIDDEN, np.int32)})
    with pytest.raises(UnsupportedModelError) as exc:
        load(path)
    assert_one_line_naming(exc, path, "blk.0.attn_norm.bias", "I32")


def test_a_gguf_tensor_name_the_loader_does_not_know_names_the_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", extra_tensors={"v.patch_embd.weight": np.zeros(HIDDEN, np.float32)})
    with pytest.raises(UnsupportedModelError) as exc:
        load(path)
    assert_one_line_naming(exc, path, "v.patch_embd.weight")


def test_every_loader_error_is_a_value_error_the_cli_prints_in_one_line():
    """The CLI prints a ValueError as `tokenloom: error: <message>` (cli.USER_ERRORS) and shows a traceback
    for anything else."""
    from tokenloom.entrypoints.cli import USER_ERRORS
    assert issubclass(ModelFileError, USER_ERRORS)
