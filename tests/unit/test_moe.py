"""Mixture of experts: tiny random Qwen3-MoE, Mixtral and Qwen2-MoE models built with transformers (8 experts,
top-2; see helpers.TINY_MOE_VARIANTS), loaded by our engine from safetensors and from GGUF files written here
with `gguf.GGUFWriter` from the same weights, compared against transformers.

Tolerance: float32 on both sides, as in test_reference_tiny.py (measured max abs logit diff 2-5e-6 on logits of
magnitude ~6; LOGIT_TOL leaves 10x). Greedy generation must be token-identical.
"""
from __future__ import annotations

import re

import gguf
import helpers
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.fused_moe import FusedMoE, grouped_experts
from tokenloom.model.layers.moe import SparseMoeBlock, select_experts
from tokenloom.model.loader import load_model

LOGIT_TOL = 5e-5
KINDS = list(helpers.TINY_MOE_VARIANTS)
PROMPTS = helpers.random_prompts(5, [1, 5, 17, 33, 64], 512, seed=1)
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe"}


def _load(path: str) -> torch.nn.Module:
    return load_model(path, torch.float32, torch.device("cpu"), progress=False).model


@pytest.fixture(scope="module")
def ours(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _load(tiny_models(kind)[0])
        return cache[kind]

    return get


# --- GGUF files written from the transformers weights, as llama.cpp's converter names and lays them out --------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _rope_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows of "llama" files (Mixtral) for its rope; our loader undoes it."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """transformers' state dict under GGUF names (torch layout; the writer reverses the dimensions)."""
    cfg = hf.config
    out = {}
    for name, tensor in hf.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = array
        elif name == "model.norm.weight":
            out["output_norm.weight"] = array
        elif name == "lm_head.weight":
            out["output.weight"] = array
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias|gate_up_proj|down_proj)", name)
            layer, module, kind = m.groups()
            if kind == "gate_up_proj":  # [experts, 2 x intermediate, hidden]: gate rows, then up rows
                half = array.shape[1] // 2
                out[f"blk.{layer}.ffn_gate_exps.weight"] = array[:, :half]
                out[f"blk.{layer}.ffn_up_exps.weight"] = array[:, half:]
                continue
            if kind == "down_proj":
                module, kind = f"{module}.down_proj", "weight"
            if module == "mlp.shared_expert_gate":
                array = array.reshape(-1)  # stored as a vector
            if GGUF_ARCH[_kind_of(cfg)] == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
                array = _rope_permute(array, heads)
            out[f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"] = array
    return out


def _kind_of(cfg) -> str:
    return {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe"}[cfg.model_type]


def write_gguf(hf, path: str, storage: dict[str, Q] | None = None) -> str:
    """A GGUF file of `hf`'s weights (float32, or the quantization `storage` names per tensor-name suffix)."""
    cfg = hf.config
    arch = GGUF_ARCH[_kind_of(cfg)]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, array in gguf_tensors(hf).items():
        qtype = next((q for suffix, q in (storage or {}).items() if name.endswith(suffix)), Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tiny_models, tmp_path_factory):
    built = {}

    def get(kind, storage=None):
        key = (kind, tuple(sorted((storage or {}).items())))
        if key not in built:
            path = str(tmp_path_factory.mktemp("moe_gguf") / f"{kind}.gguf")
            built[key] = write_gguf(tiny_models(kind)[1], path, storage)
        return built[key]

    return get


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "0")


# --- the routing and the grouped computation ---------------------------------------------------------------

def _per_token_reference(x, w13, w2, weights, ids):
    """The definition: for each token, the weighted sum of its chosen experts' SwiGLU MLPs (a loop over tokens)."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _random_experts(tokens=13, hidden=16, inter=8, experts=6, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def test_grouped_experts_equal_the_per_token_definition():
    """Equal up to float32 rounding: the grouped path multiplies each expert's rows as one GEMM (blocked by
    oneDNN per the CPU's ISA) and adds the k outputs in another order; measured up to 1.4e-5 apart (a
    relative 5.4e-6) on an AVX512 machine, where the default 1e-5 absolute tolerance is too tight."""
    x, w13, w2, weights, ids = _random_experts()
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids),
                               _per_token_reference(x, w13, w2, weights, ids), rtol=1.3e-6, atol=5e-5)


def test_experts_split_over_two_expert_maps_sum_to_the_whole():
    """Each rank of an expert-parallel pair computes only the pairs of its experts; the sum is the full output."""
    x, w13, w2, weights, ids = _random_experts(experts=6)
    mine, theirs = [0, 2, 4], [1, 3, 5]  # round-robin placement over two ranks
    parts = []
    for held in (mine, theirs):
        expert_map = torch.full((6,), -1, dtype=torch.long)
        expert_map[held] = torch.arange(3)
        parts.append(grouped_experts(x, w13[held], w2[held], weights, ids, expert_map))
    torch.testing.assert_close(parts[0] + parts[1], grouped_experts(x, w13, w2, weights, ids))


def test_routing_renormalizes_the_top_k_weights_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    raw, ids = select_experts(logits, 2, renormalize=False)
    normed, same_ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == same_ids.tolist() == [[0, 1]]
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, :2])
    torch.testing.assert_close(normed, torch.softmax(logits[:, :2], -1))  # Mixtral's softmax over the top-k


# --- whole models against transformers ------------------------------------------------------------------

def test_variants_exercise_the_features_they_name(ours):
    qwen3, mixtral, qwen2 = ours("qwen3_moe"), ours("mixtral"), ours("qwen2_moe")
    assert qwen3.config.norm_topk_prob and qwen3.config.qk_norm
    assert isinstance(qwen3.model.layers[0].mlp, SparseMoeBlock)
    assert not isinstance(qwen3.model.layers[1].mlp, SparseMoeBlock)  # mlp_only_layers
    assert mixtral.config.norm_topk_prob and mixtral.config.moe_intermediate_size == mixtral.config.intermediate_size
    assert not qwen2.config.norm_topk_prob and qwen2.config.attention_bias
    assert qwen2.model.layers[0].mlp.shared_expert is not None


@pytest.mark.parametrize("kind", KINDS)
def test_final_logits_match_transformers(kind, tiny_models, ours):
    got = helpers.last_logits(ours(kind), PROMPTS)
    want = helpers.hf_last_logits(tiny_models(kind)[1], PROMPTS)
    assert (got - want).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_is_token_identical_to_transformers(kind, tiny_models, make_core):
    hf = tiny_models(kind)[1]
    prompts = PROMPTS[1:4]
    got = helpers.generate_tokens(make_core(kind), prompts, helpers.greedy_params(12))
    assert got == helpers.hf_greedy_batch(hf, prompts, 12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_file_of_the_same_weights_gives_the_same_logits(kind, tiny_models, gguf_files):
    """Stacked ffn_{gate,up,down}_exps, the router ffn_gate_inp, the shared expert *_shexp; Mixtral as a
    "llama" file with experts and rope-permuted q/k."""
    model = _load(gguf_files(kind))
    assert type(model).__name__ == type(tiny_models(kind)[1]).__name__
    got = helpers.last_logits(model, PROMPTS)
    want = helpers.hf_last_logits(tiny_models(kind)[1], PROMPTS)
    assert (got - want).abs().max().item() < LOGIT_TOL


def _hf_from_gguf(path: str, original):
    """transformers' model with `original`'s config (its GGUF config mapping has no expert width), the weights
    read and dequantized from `path` by transformers' GGUF loader; it does not map a dense MLP between MoE
    layers, stored in float32, so those come from `original`."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(original.config, dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".1.mlp." in name for name in missing), (missing, unexpected)
    model.load_state_dict({name: original.state_dict()[name] for name in missing}, strict=False)
    return model.eval()


def test_quantized_gguf_experts_match_transformers_on_the_same_file(tiny_models, gguf_files):
    """Q8_0 expert and router tensors, dequantized by transformers' own GGUF loader as the reference."""
    path = gguf_files("qwen3_moe", {"_exps.weight": Q.Q8_0, "ffn_gate_inp.weight": Q.Q8_0})
    hf = _hf_from_gguf(path, tiny_models("qwen3_moe")[1])
    got = helpers.last_logits(_load(path), PROMPTS)
    assert (got - helpers.hf_last_logits(hf, PROMPTS)).abs().max().item() < LOGIT_TOL
    tokens = helpers.hf_greedy_batch(hf, PROMPTS[:3], 12)
    for prompt, continuation in zip(PROMPTS[:3], tokens):
        assert helpers.greedy_mismatch(_load(path), prompt, continuation) is None


def test_gguf_metadata_becomes_the_moe_config(gguf_files):
    arch = ArchConfig.from_gguf(*_metadata(gguf_files("qwen2_moe")))
    assert (arch.architecture, arch.num_experts, arch.num_experts_per_tok) == ("Qwen2MoeForCausalLM", 8, 2)
    assert (arch.moe_intermediate_size, arch.shared_expert_intermediate_size, arch.norm_topk_prob) == (32, 48, False)
    assert ArchConfig.from_gguf(*_metadata(gguf_files("qwen3_moe"))).mlp_only_layers == [1]  # no router tensor
    assert ArchConfig.from_gguf(*_metadata(gguf_files("mixtral"))).architecture == "MixtralForCausalLM"


def _metadata(path: str):
    from tokenloom.model.loader.gguf_loader import GGUFModelFile
    f = GGUFModelFile(path)
    return f.metadata, {t.name for t in f.reader.tensors}


def test_a_stacked_tensor_with_the_wrong_expert_count_is_refused():
    with torch.device("meta"):
        experts = FusedMoE(num_experts=4, hidden_size=8, intermediate_size=4)
    with pytest.raises(ValueError, match="has 3 experts, the model 4"):
        experts.load("gate_proj.weight", torch.zeros(3, 4, 8))


def test_reduced_precision_matmuls_cast_the_experts_and_stay_close(tiny_models):
    """--matmul-dtype bfloat16 stores the experts like the linear layers (one rounding of each weight)."""
    from tokenloom.model.matmul_dtype import cast_matmul_weights
    model = _load(tiny_models("qwen2_moe")[0])
    cast_matmul_weights(model, torch.bfloat16)
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    got = helpers.last_logits(model, PROMPTS)
    want = helpers.hf_last_logits(tiny_models("qwen2_moe")[1], PROMPTS)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()  # measured 0.11 of 6.1


def test_the_moe_benchmark_checks_its_variants_agree_before_timing():
    from tokenloom.bench.moe_layer import time_layers
    ms = time_layers(hidden=16, experts=4, top_k=2, width=8, layers=2, batch=5, repeats=1)
    assert set(ms) == {"grouped", "grouped_prepacked", "per_expert_masks", "per_token_loop", "dense_same_active"}


def test_a_moe_gguf_reloads_from_the_weight_cache_with_the_same_logits(gguf_files, tmp_path, monkeypatch):
    """The cache stores the stacked expert tensors under their HF names and the MoE fields of the config."""
    from tokenloom.model.loader import keeps_quantized, open_model_source
    from tokenloom.model.loader.weight_cache import CachedWeights
    monkeypatch.setenv("TOKENLOOM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path))
    path = gguf_files("qwen2_moe")
    first = helpers.last_logits(_load(path), PROMPTS)
    # the entry _load wrote: the repacked blocks when the native kernels run, dense float32 otherwise
    source = open_model_source(path, torch.float32, keeps_quantized(path, torch.device("cpu"), torch.float32))
    assert isinstance(source, CachedWeights) and source.arch_config.shared_expert_intermediate_size == 48
    assert torch.equal(helpers.last_logits(_load(path), PROMPTS), first)


def test_the_cpu_engine_runs_the_experts_prepacked_for_onednn(make_core):
    """Packing drops the stacked weights (no doubled memory); the greedy tests above run this path."""
    from tokenloom.model.prepack import can_prepack
    if not can_prepack(torch.device("cpu")):
        pytest.skip("this torch build cannot prepack for oneDNN")
    experts = make_core("qwen3_moe").executor.worker.setup.loaded.model.model.layers[0].mlp.experts
    assert experts.packed is not None and all(w.is_mkldnn for w in experts.packed[0] + experts.packed[1])
    assert len(experts.packed[0]) == 8 and experts.w13.numel() == 0
