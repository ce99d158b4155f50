"""GGUF loading: a tiny Llama written with `gguf.GGUFWriter` loads to the exact dequantized values.

The file is built in the test: 2 layers, hidden 256, ffn 512, 4 heads (head_dim 64), 2 kv heads, vocab 256.
Every tensor is stored in one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (K-quants, which the gguf
package cannot quantize, are random blocks with small float16 scales). q/k rows are written in llama.cpp's
rope order, as its converter does, and must come back in HF order. Expected values are computed from the
stored bytes with `gguf.quants.dequantize`, in HF (torch) layout, never through the loader's own code.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenloom.model.arch_config import UnsupportedModelError
from tokenloom.model.loader import load_model, open_model_source
from tokenloom.model.loader.gguf_loader import CorruptModelError, GGUFModelFile
from tokenloom.model.loader.weight_cache import CachedWeights

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT, ROPE_THETA, RMS_EPS = 512, 500000.0, 1e-5

# GGUF tensor name -> how it is stored. Every type appears both on plain and on q/k (permuted) tensors.
STORAGE: dict[str, Q] = {
    "token_embd.weight": Q.Q4_K,
    "output_norm.weight": Q.F32,
    "output.weight": Q.Q6_K,
    "blk.0.attn_norm.weight": Q.F32,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q4_1,
    "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.attn_output.weight": Q.BF16,
    "blk.0.ffn_norm.weight": Q.F32,
    "blk.0.ffn_gate.weight": Q.Q4_K,
    "blk.0.ffn_up.weight": Q.Q6_K,
    "blk.0.ffn_down.weight": Q.F16,
    "blk.1.attn_norm.weight": Q.F32,
    "blk.1.attn_q.weight": Q.F32,
    "blk.1.attn_k.weight": Q.Q6_K,
    "blk.1.attn_v.weight": Q.Q4_K,
    "blk.1.attn_output.weight": Q.Q4_0,
    "blk.1.ffn_norm.weight": Q.F32,
    "blk.1.ffn_gate.weight": Q.BF16,
    "blk.1.ffn_up.weight": Q.Q8_0,
    "blk.1.ffn_down.weight": Q.Q4_1,
}
STORED_TYPES = sorted({qtype.name for qtype in STORAGE.values()})
K_QUANTS = {Q.Q4_K, Q.Q6_K}

_HF_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_HF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_HF_LAYER[parts[2]]}.weight"
    return f"{_HF_TOP[parts[0]]}.weight"


def torch_shape(gguf_name: str) -> tuple[int, ...]:
    """The HF (torch) shape; GGUF stores the same dimensions reversed."""
    kind = gguf_name.split(".")[-2]
    return {
        "token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN),
        "output_norm": (HIDDEN,), "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
    }[kind]


def rope_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute: HF row order -> interleaved rope order (axis 0 only)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permuted_heads(gguf_name: str) -> int | None:
    kind = gguf_name.split(".")[-2]
    return {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind)


def random_k_quant_rows(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Random K-quant blocks (uint8, one row of blocks per torch row) whose float16 scales are small and finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)

    def scale(n):
        return rng.uniform(1e-4, 2e-3, size=(rows, cols // block_size, n)).astype(np.float16).view(np.uint8)

    if qtype == Q.Q4_K:  # d, dmin (float16) lead the block
        blocks[..., 0:4] = scale(2)
    else:  # Q6_K: d (float16) ends the block
        blocks[..., type_size - 2:] = scale(1)
    return blocks.reshape(rows, -1)


def stored_rows(rng: np.random.Generator, original: np.ndarray, qtype: Q) -> np.ndarray:
    """The bytes/values a GGUF file holds for `original` (torch layout, HF row order)."""
    if qtype in K_QUANTS:
        return random_k_quant_rows(rng, qtype, original.shape)
    return gguf.quants.quantize(original, qtype)


def dequantized(rows: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape))


@dataclass
class TinyGGUF:
    path: str
    originals: dict[str, np.ndarray] = field(default_factory=dict)  # HF name -> float32 before storing
    expected: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> dequantized, HF order
    file_rows: dict[str, np.ndarray] = field(default_factory=dict)  # GGUF name -> what was written


def add_llama_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(VOCAB)


def write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_tiny_llama(path: str, storage: dict[str, Q] = STORAGE, seed: int = 0) -> TinyGGUF:
    rng = np.random.default_rng(seed)
    tiny = TinyGGUF(path)
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_metadata(writer)
    for name, qtype in storage.items():
        shape = torch_shape(name)
        original = rng.standard_normal(shape).astype(np.float32) * (0.1 if len(shape) == 2 else 1.0)
        rows = stored_rows(rng, original, qtype)
        tiny.originals[hf_name(name)] = original
        tiny.expected[hf_name(name)] = dequantized(rows, qtype, shape)
        heads = permuted_heads(name)
        if heads is not None:  # quantization is row-wise, so whole rows can be reordered
            rows = rope_permute(rows, heads)
        tiny.file_rows[name] = rows
        writer.add_tensor(name, rows, raw_dtype=qtype)
    write_gguf(writer)
    return tiny


def loaded_parameter(model: torch.nn.Module, name: str) -> torch.Tensor:
    """A checkpoint (HF-named) tensor as it sits in our model, which stacks q/k/v and gate/up; a weight kept
    quantized for the native kernels (tokenloom/model/layers/quantized_weight.py) as its float values."""
    merged = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    module_path, _, param = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if leaf in merged:
        leaf, shard = merged[leaf]
        module = model.get_submodule(f"{parent}.{leaf}")
        start, size = module.offsets[shard]
        return _values(getattr(module, param)).narrow(0, start, size)
    return _values(getattr(model.get_submodule(module_path), param))


def _values(weight) -> torch.Tensor:
    return weight.detach() if isinstance(weight, torch.Tensor) else weight.dequantize()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    return build_tiny_llama(str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"))


@pytest.fixture(scope="module")
def loaded(tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENLOOM_WEIGHT_CACHE", "0")
        mp.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """No test reads or writes the user's cache; the weight cache is off unless a test turns it on."""
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "0")


# --- metadata -------------------------------------------------------------------------------------------

def test_llama_metadata_becomes_the_architecture_config(loaded):
    arch = loaded.arch
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB, HIDDEN, FFN)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert arch.max_position_embeddings == CONTEXT
    assert arch.rope_theta == ROPE_THETA
    assert arch.rms_norm_eps == pytest.approx(RMS_EPS)
    assert arch.tie_word_embeddings is False  # the file has output.weight
    assert arch.attention_bias is False and arch.qk_norm is False


def test_every_model_parameter_comes_from_the_file(tiny, loaded):
    """Shapes line up with the reversed GGUF shapes, and the model has no parameter the file did not fill."""
    expected_numel = sum(t.numel() for t in tiny.expected.values())
    assert loaded.num_params == expected_numel
    for name, want in tiny.expected.items():
        assert tuple(loaded_parameter(loaded.model, name).shape) == tuple(want.shape), name


# --- values, per storage type ---------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", STORED_TYPES)
def test_tensors_load_as_their_dequantized_stored_values(tiny, loaded, type_name):
    names = [n for n, qtype in STORAGE.items() if qtype.name == type_name]
    assert names
    for gguf_name in names:
        name = hf_name(gguf_name)
        got = loaded_parameter(loaded.model, name)
        assert got.dtype == torch.float32
        assert torch.isfinite(got).all(), name
        assert torch.equal(got, tiny.expected[name]), f"{gguf_name} ({type_name}) differs from its stored values"


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_0"])
def test_quantized_values_approximate_the_original_weights(tiny, type_name):
    """A check on the test's own fixture: what we stored really is (a rounding of) the original weights."""
    tolerance = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q4_1": 0.12, "Q4_0": 0.15}[type_name]
    for gguf_name, qtype in STORAGE.items():
        if qtype.name == type_name:
            name = hf_name(gguf_name)
            original = torch.from_numpy(tiny.originals[name])
            error = (tiny.expected[name] - original).abs().max() / original.abs().max()
            assert error <= tolerance, f"{gguf_name}: relative error {error:.4f}"


def test_q_and_k_rows_are_restored_from_llama_cpp_rope_order(tiny, loaded):
    """The file holds q/k rows interleaved for llama.cpp's rope; the loader puts them back in HF order."""
    q_name = "blk.1.attn_q.weight"  # stored as F32: exact
    original = tiny.originals[hf_name(q_name)]
    in_file = gguf.GGUFReader(tiny.path).get_tensor(list(STORAGE).index(q_name))
    assert in_file.name == q_name
    assert not np.array_equal(np.asarray(in_file.data), original)
    assert np.array_equal(np.asarray(in_file.data), rope_permute(original, HEADS))
    assert torch.equal(loaded_parameter(loaded.model, hf_name(q_name)), torch.from_numpy(original))


def test_loads_in_the_requested_dtype(tiny):
    bf16 = load_model(tiny.path, torch.bfloat16, torch.device("cpu"), progress=False)
    for name, want in tiny.expected.items():
        got = loaded_parameter(bf16.model, name)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.to(torch.bfloat16)), name


# --- weight cache ---------------------------------------------------------------------------------------

def test_weight_cache_round_trip_gives_identical_parameters(tiny, tmp_path, monkeypatch):
    """The dense entry (the torch path's); a quantized model's loaded form round-trips in test_panel_cache.py."""
    monkeypatch.setattr("tokenloom.model.loader.keeps_quantized", lambda *args: False)
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    quantized = False
    assert isinstance(open_model_source(tiny.path, torch.float32, quantized), GGUFModelFile)  # cold: nothing cached

    first = load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False)
    assert sorted(p.suffix for p in (tmp_path / "cache" / "weights").iterdir()) == [".json", ".safetensors"]
    assert isinstance(open_model_source(tiny.path, torch.float32, quantized), CachedWeights)  # warm: from the cache

    second = load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False)
    assert second.arch == first.arch
    first_params, second_params = dict(first.model.named_parameters()), dict(second.model.named_parameters())
    assert first_params.keys() == second_params.keys()
    for name in first_params:
        assert torch.equal(first_params[name], second_params[name]), name
    for name, want in tiny.expected.items():
        assert torch.equal(loaded_parameter(second.model, name), want), name


def test_weight_cache_is_not_written_when_disabled(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "0")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    load_model(tiny.path, torch.float32, torch.device("cpu"), progress=False)
    assert not (tmp_path / "cache" / "weights").exists()


# --- warnings -------------------------------------------------------------------------------------------

def test_loading_the_embedded_gguf_emits_no_warning(embedded_path):
    """The file's float tensors reach torch.from_numpy straight from the memory map, without a copy; a
    read-only map made torch warn ("The given NumPy array is not writable") on every load."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(embedded_path, torch.float32, torch.device("cpu"), progress=False)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


# --- errors ---------------------------------------------------------------------------------------------

def test_unsupported_architecture_is_rejected_by_name(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    write_gguf(writer)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path, torch.float32, torch.device("cpu"), progress=False)


@pytest.mark.parametrize("missing", ["blk.1.ffn_down.weight", "blk.0.attn_k.weight", "output_norm.weight"])
def test_file_missing_a_tensor_is_reported_as_corrupt_naming_the_file_and_tensor(tmp_path, missing):
    """An incomplete file must not load: the missing weights would otherwise be uninitialized memory."""
    path = str(tmp_path / "incomplete.gguf")
    build_tiny_llama(path, {name: qtype for name, qtype in STORAGE.items() if name != missing})
    with pytest.raises(CorruptModelError) as excinfo:
        load_model(path, torch.float32, torch.device("cpu"), progress=False)
    assert path in str(excinfo.value)
    assert hf_name(missing) in str(excinfo.value)


def test_truncated_file_is_reported_as_corrupt_naming_the_file(tiny, tmp_path):
    path = tmp_path / "truncated.gguf"
    data = Path(tiny.path).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError) as excinfo:
        load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
    assert str(path) in str(excinfo.value)


def test_file_cut_inside_its_header_is_reported_as_corrupt_naming_the_file(tiny, tmp_path):
    path = tmp_path / "header-only.gguf"
    path.write_bytes(Path(tiny.path).read_bytes()[:200])
    with pytest.raises(CorruptModelError) as excinfo:
        load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
    assert str(path) in str(excinfo.value)


def test_garbage_file_is_reported_as_corrupt_naming_the_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CorruptModelError) as excinfo:
        load_model(str(path), torch.float32, torch.device("cpu"), progress=False)
    assert str(path) in str(excinfo.value)
