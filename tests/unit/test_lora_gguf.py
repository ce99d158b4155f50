"""llama.cpp GGUF LoRA files: a PEFT adapter written in llama.cpp's layout (`convert_lora_to_gguf.py`: metadata
general.type "adapter", adapter.type "lora", adapter.lora.alpha; pairs blk.N.<target>.weight.lora_a / lora_b;
a Llama's q and k B rows in llama.cpp's rope order) reads back as the PEFT folder's adapter."""
from __future__ import annotations

import gguf
import helpers
import numpy as np
import pytest
import torch

from tokenloom.core.lora_request import LoRARequest
from tokenloom.lora.adapter import LoRAAdapterError
from tokenloom.lora.gguf_loader import GGUF_TARGETS, is_gguf_lora, load_gguf_lora_adapter, read_gguf_lora_spec
from tokenloom.lora.peft_loader import load_peft_adapter

RANK, ALPHA = 8, 16
_GGUF_NAME = {target: name for name, target in GGUF_TARGETS.items()}


def _permute_like_llama_cpp(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k order for Llama: each head's two rotary halves interleaved, row by row."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def write_gguf_lora(adapter, config, path: str, qtype: str = "F32", arch: str = "llama") -> str:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(adapter.alpha))
    dtype = gguf.GGMLQuantizationType[qtype]
    for (layer, target), pair in sorted(adapter.weights.items()):
        b = pair.b
        if arch == "llama" and target in ("q_proj", "k_proj"):
            b = _permute_like_llama_cpp(b, config.num_attention_heads if target == "q_proj"
                                        else config.num_key_value_heads)
        for suffix, tensor in (("lora_a", pair.a), ("lora_b", b)):
            name = f"blk.{layer}.{_GGUF_NAME[target]}.weight.{suffix}"
            array = np.ascontiguousarray(tensor.numpy())
            if dtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, array)
            elif dtype == gguf.GGMLQuantizationType.F16 or array.shape[-1] % 32:  # llama.cpp: Q8_0 needs 32s
                writer.add_tensor(name, array.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(array, dtype), raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def peft_made(tiny_models, tmp_path_factory):
    """(the adapter as read from its PEFT folder, the tiny Llama's config, the PEFT model: the reference)."""
    hf = tiny_models("llama")[1]
    folder, peft_model = helpers.make_peft_adapter(hf, str(tmp_path_factory.mktemp("peft")), r=RANK, alpha=ALPHA,
                                                   seed=3)
    return load_peft_adapter(LoRARequest("peft", 1, folder)), hf.config, peft_model


@pytest.fixture(scope="module")
def peft_adapter(peft_made):
    return peft_made[:2]


def _load(path: str, config):
    return load_gguf_lora_adapter(LoRARequest("gguf", 2, path), config.num_attention_heads,
                                  config.num_key_value_heads)


def test_an_f32_file_holds_the_peft_adapters_pairs_exactly(peft_adapter, tmp_path):
    adapter, config = peft_adapter
    loaded = _load(write_gguf_lora(adapter, config, str(tmp_path / "a.gguf")), config)
    assert (loaded.rank, loaded.alpha, loaded.scaling) == (RANK, ALPHA, adapter.scaling)
    assert loaded.weights.keys() == adapter.weights.keys()
    for key, pair in adapter.weights.items():
        assert torch.equal(loaded.weights[key].a, pair.a) and torch.equal(loaded.weights[key].b, pair.b), key


@pytest.mark.parametrize("qtype,tolerance", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2)])
def test_f16_bf16_and_q8_0_files_read_within_their_rounding(peft_adapter, tmp_path, qtype, tolerance):
    adapter, config = peft_adapter
    loaded = _load(write_gguf_lora(adapter, config, str(tmp_path / "a.gguf"), qtype), config)
    for key, pair in adapter.weights.items():
        for got, want in ((loaded.weights[key].a, pair.a), (loaded.weights[key].b, pair.b)):
            assert got.dtype == torch.float32
            scale = want.abs().max()
            assert (got - want).abs().max() <= tolerance * scale, (key, qtype)


def test_a_file_of_an_architecture_without_the_rope_permutation_is_read_as_written(peft_adapter, tmp_path):
    adapter, config = peft_adapter
    path = write_gguf_lora(adapter, config, str(tmp_path / "a.gguf"), arch="qwen2")
    loaded = load_gguf_lora_adapter(LoRARequest("gguf", 2, path))
    assert torch.equal(loaded.weights[(0, "q_proj")].b, adapter.weights[(0, "q_proj")].b)


def test_the_spec_gives_every_pairs_shape_as_a_peft_folders_does(peft_adapter, tmp_path):
    adapter, config = peft_adapter
    spec = read_gguf_lora_spec(write_gguf_lora(adapter, config, str(tmp_path / "a.gguf")))
    assert (spec.rank, spec.alpha) == (RANK, ALPHA)
    for (layer, target), pair in adapter.weights.items():
        assert spec.shapes[(layer, target, "A")] == tuple(pair.a.shape)
        assert spec.shapes[(layer, target, "B")] == tuple(pair.b.shape)


def test_a_gguf_model_file_is_not_taken_for_an_adapter(tmp_path):
    hf = helpers.build_tiny_model("qwen2")
    path = helpers.write_tiny_gguf(hf, "qwen2", str(tmp_path / "model.gguf"), {})
    assert is_gguf_lora(path)  # a GGUF file by its magic...
    with pytest.raises(LoRAAdapterError, match="not a LoRA adapter"):  # ...but not an adapter
        read_gguf_lora_spec(path)


def test_a_truncated_file_is_refused_in_one_line(peft_adapter, tmp_path):
    adapter, config = peft_adapter
    path = write_gguf_lora(adapter, config, str(tmp_path / "a.gguf"))
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(LoRAAdapterError) as err:
        _load(path, config)
    assert "\n" not in str(err.value)


def test_a_llama_file_training_q_needs_the_base_models_head_count(peft_adapter, tmp_path):
    adapter, config = peft_adapter
    path = write_gguf_lora(adapter, config, str(tmp_path / "a.gguf"))
    with pytest.raises(LoRAAdapterError, match="head count"):
        load_gguf_lora_adapter(LoRARequest("gguf", 2, path))


def test_the_engine_serving_the_gguf_file_matches_transformers_with_peft(peft_made, make_core, tmp_path):
    adapter, config, reference = peft_made
    path = write_gguf_lora(adapter, config, str(tmp_path / "a.gguf"))
    core = make_core("llama", enable_lora=True)
    prompt = helpers.random_prompts(1, [13], 512, seed=5)[0]
    req = helpers.make_request("r", prompt, helpers.greedy_params(8))
    req.lora_request = LoRARequest("gguf", 7, path)
    core.add_request(req)
    assert helpers.run_to_completion(core)[("r", 0)] == helpers.hf_greedy(reference, prompt, 8)
