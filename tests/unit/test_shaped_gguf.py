"""scripts/shaped_gguf.py: a file with given shapes and random quantized blocks that `gguf`'s reader and
tokenloom's loader both read as declared (a 2-layer shape here; the real ones differ only in size)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.model.layers.quantized_weight import QuantizedWeight
from tokenloom.model.loader.gguf_loader import GGUFModelFile, hf_name
from tokenloom.model.model_path import embedded_model_path
from tokenloom.tokenizer.gguf_metadata import read_gguf_metadata

_SPEC = importlib.util.spec_from_file_location("shaped_gguf", Path(__file__).parents[2] / "scripts" / "shaped_gguf.py")
shaped_gguf = importlib.util.module_from_spec(_SPEC)
sys.modules["shaped_gguf"] = shaped_gguf  # its dataclasses look their module up
_SPEC.loader.exec_module(shaped_gguf)

VOCAB = 49_216  # the embedded tokenizer's 49,152 tokens padded by 64
TINY = shaped_gguf.ModelShape("tiny", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=VOCAB, tied_head=True,
                              context=1024)
UNTIED = shaped_gguf.ModelShape("tiny-untied", 256, 2, 4, 2, 512, VOCAB, tied_head=False, context=1024)


def _write(tmp_path: Path, shape, quant: str, seed: int = 0) -> Path:
    out = tmp_path / f"{shape.name}-{quant}-{seed}.gguf"
    shaped_gguf.write_shaped_gguf(shape, quant, out, seed)
    return out


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("shaped"), TINY, "q4_k_m")


@pytest.fixture(scope="module")
def q4_0(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("shaped"), UNTIED, "q4_0")


@pytest.fixture(scope="module")
def opened(q4_k_m, q4_0) -> dict[str, GGUFModelFile]:
    """Each file opened once by tokenloom's loader (whose `reader` is gguf's own): parsing a 49k-token
    vocabulary is most of this test's time."""
    return {"q4_k_m": GGUFModelFile(str(q4_k_m)), "q4_0": GGUFModelFile(str(q4_0))}


def test_gguf_reader_sees_the_declared_shapes_and_types(opened):
    reader = opened["q4_k_m"].reader
    declared = {name: (dims, kind) for name, dims, kind in shaped_gguf.tensor_types(TINY, "q4_k_m")}
    assert {t.name for t in reader.tensors} == set(declared)
    for t in reader.tensors:
        dims, kind = declared[t.name]
        assert t.tensor_type == kind, t.name
        assert tuple(reversed(t.shape.tolist())) == dims, t.name


def test_q4_k_m_puts_q6_k_where_llama_cpp_does():
    types = {name: kind for name, _, kind in shaped_gguf.tensor_types(shaped_gguf.SHAPES["llama-3.2-1b"], "q4_k_m")}
    more_bits = [i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == Q.Q6_K]
    assert more_bits == [0, 1, 4, 7, 10, 13, 14, 15]  # llama.cpp's use_more_bits over 16 layers
    assert [types[f"blk.{i}.ffn_down.weight"] == Q.Q6_K for i in range(16)] == [i in more_bits for i in range(16)]
    assert types["token_embd.weight"] == Q.Q6_K  # the tied head's type
    assert types["blk.3.attn_q.weight"] == Q.Q4_K


def test_an_untied_head_is_its_own_q6_k_tensor_and_the_embedding_stays_in_the_base_type():
    types = {name: kind for name, _, kind in shaped_gguf.tensor_types(UNTIED, "q4_0")}
    assert types["output.weight"] == Q.Q6_K
    assert types["token_embd.weight"] == Q.Q4_0


def test_weights_are_finite_centred_and_spread_like_an_initialized_model(opened):
    for t in opened["q4_k_m"].reader.tensors:
        if t.tensor_type == Q.F32:
            continue
        w = quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        assert abs(float(w.mean())) < 0.002, t.name
        assert 0.01 < float(w.std()) < 0.04, t.name


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path, q4_0):
    again, other = _write(tmp_path, UNTIED, "q4_0", 0), _write(tmp_path, UNTIED, "q4_0", 1)
    assert again.read_bytes() == q4_0.read_bytes()
    assert other.read_bytes() != q4_0.read_bytes()


def test_the_vocabulary_is_the_embedded_tokenizer_padded_with_control_tokens(q4_k_m):
    shaped, embedded = read_gguf_metadata(str(q4_k_m)), read_gguf_metadata(embedded_model_path(), "tokenizer.")
    tokens, types = shaped["tokenizer.ggml.tokens"], shaped["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == shaped["llama.vocab_size"] == VOCAB
    assert tokens[:len(embedded["tokenizer.ggml.tokens"])] == embedded["tokenizer.ggml.tokens"]
    assert tokens[-1] == "<|reserved_special_token_63|>" and types[-1] == 3
    assert shaped["tokenizer.ggml.merges"] == embedded["tokenizer.ggml.merges"]


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_tokenloom_reads_every_weight_quantized_with_its_declared_shape(opened, quant):
    shape = TINY if quant == "q4_k_m" else UNTIED
    model = opened[quant]
    cfg = model.arch_config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size,
            cfg.tie_word_embeddings) == (256, 2, 4, 2, 512, VOCAB, shape.tied_head)
    declared = {hf_name(name): dims for name, dims, _ in shaped_gguf.tensor_types(shape, quant)}
    loaded = dict(model.tensors(torch.float32, quantized=True))
    assert set(loaded) == set(declared)
    for name, tensor in loaded.items():
        assert tuple(tensor.shape) == declared[name], name
        assert isinstance(tensor, QuantizedWeight) == (len(declared[name]) == 2), name
