"""Gemma 3 against transformers on the same weights: a tiny random model built here (every feature switched
to a value that shows when it is dropped: windowed and global layers with different rotary bases, a query
scale that is not head_dim**-0.5, final-logit soft-capping, random (1 + w) norms), and the real Gemma 3
270M Q4_K_M GGUF (`gemma3-270m`), whose local layers attend over 512 tokens.

Tolerance: float32 on both sides; tiny-model logits within 5e-5 (as test_reference_tiny.py), greedy
output token-identical.
"""
from __future__ import annotations

import helpers
import numpy as np
import pytest
import torch
import transformers
from skip_policy import require_kernels

from tokenloom.config import EngineConfig
from tokenloom.engine.core import EngineCore
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.loader import load_model, open_model_source
from tokenloom.model.model_path import resolve_model_path
from tokenloom.tokenizer import Tokenizer

WINDOW = helpers.TINY_GEMMA3_WINDOW
LOGIT_TOL = 5e-5


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """(folder, transformers model): 3 layers (windowed, global, windowed), window 8."""
    hf = helpers.build_tiny_gemma3()
    return helpers.save_tiny_model(hf, str(tmp_path_factory.mktemp("tiny_gemma3"))), hf


@pytest.fixture(scope="module")
def prompts():
    return helpers.random_prompts(4, [5, 17, 30, 47], 512, seed=2)


def _core(model: str, **engine_args) -> EngineCore:
    args = dict(device="cpu", dtype="float32", log_stats_interval=0)
    return EngineCore(EngineConfig.from_kwargs(model=model, **{**args, **engine_args}), progress=False)


def test_the_tiny_model_has_the_features_under_test(tiny_gemma):
    cfg = load_model(tiny_gemma[0], torch.float32, torch.device("cpu"), progress=False).model.config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (cfg.rope_local_theta, cfg.rope_theta) == (100.0, 10000.0)
    assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (24, 30.0)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.hidden_activation == "gelu_pytorch_tanh"


def test_tiny_gemma3_logits_match_transformers_whole_and_split_over_the_paged_cache(tiny_gemma, prompts):
    folder, hf = tiny_gemma
    model = load_model(folder, torch.float32, torch.device("cpu"), progress=False).model
    want = helpers.hf_last_logits(hf, prompts)
    assert (helpers.last_logits(model, prompts) - want).abs().max().item() < LOGIT_TOL
    assert (helpers.last_logits(model, prompts, block_size=4, split_at=11) - want).abs().max().item() < LOGIT_TOL


def test_tiny_gemma3_greedy_past_the_window_is_token_identical_with_chunked_prefill(tiny_gemma, prompts):
    """Block size 4, a 7-token step budget: chunks, decodes and both kinds of layer over the paged cache."""
    folder, hf = tiny_gemma
    core = _core(folder, num_blocks=96, block_size=4, max_num_batched_tokens=7, long_prefill_token_threshold=5)
    got = helpers.generate_tokens(core, prompts, helpers.greedy_params(24))
    for prompt, tokens in zip(prompts, got):
        assert tokens == helpers.hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"


def test_a_model_with_global_layers_keeps_every_block(tiny_gemma):
    """The global layer reads the whole context, so nothing is freed behind the window."""
    assert _core(tiny_gemma[0], num_blocks=32, block_size=4).kv_manager.sliding_window is None


# ---- a tiny Gemma 3 GGUF, written here as llama.cpp's converter writes one --------------------------------
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest.removesuffix('.weight')]}.weight"


def _write_gemma3_gguf(path: str, hf, embedding_type: str = "F32") -> str:
    """`hf` (6 layers, heads of 256) as llama.cpp's converter writes it: norms with the 1 added, every tensor
    F32 but the tied embedding, stored as `embedding_type` (F32 or Q8_0, the 270M file's)."""
    import gguf
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(6)
    writer.add_context_length(helpers.TINY_COMMON["max_position_embeddings"])
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    writer.add_vocab_size(512)
    qtype = gguf.GGMLQuantizationType[embedding_type]
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "lm_head.weight":
                continue
            data = ((p + 1) if "norm" in name else p).numpy().astype(np.float32)
            if name == "model.embed_tokens.weight" and qtype != gguf.GGMLQuantizationType.F32:
                writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gemma_gguf(tmp_path_factory):
    """(path, transformers model): 6 layers, so Gemma 3's defaults (the file cannot name them) make the 6th
    global; heads of 256 like the released models', where the query scale both transformers and llama.cpp
    assume (256 and head_dim) agree; F32 tensors, norms stored with the 1 added as llama.cpp's converter
    stores them."""
    config = transformers.Gemma3TextConfig(
        **{**helpers.TINY_COMMON, "num_hidden_layers": 6, "num_key_value_heads": 2, "head_dim": 256},
        sliding_window=WINDOW, query_pre_attn_scalar=256,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 50000.0}})
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("tiny_gemma3_gguf") / "tiny-gemma3.gguf")
    return _write_gemma3_gguf(path, hf), hf


def test_a_gemma3_gguf_loads_to_the_model_it_was_written_from_as_transformers_reads_it(tiny_gemma_gguf, prompts):
    """Names (Gemma's ffn_norm is the pre-MLP norm), the norms' +1, and the defaults for what the file does not
    say (layer kinds, local rotary base, query scale) against the source model and transformers' GGUF load."""
    path, source = tiny_gemma_gguf
    model = load_model(path, torch.float32, torch.device("cpu"), progress=False).model
    assert [model.config.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    got = helpers.last_logits(model, prompts, block_size=4, split_at=11)
    assert (got - helpers.hf_last_logits(source, prompts)).abs().max().item() < LOGIT_TOL
    theirs = helpers.load_hf_from_gguf(path)
    assert (got - helpers.hf_last_logits(theirs, prompts)).abs().max().item() < LOGIT_TOL


def test_a_q8_0_tied_embedding_stays_in_its_blocks_as_the_output_head(tiny_gemma_gguf, prompts, tmp_path):
    """The 270M file stores its 262,144 x 640 tied embedding as Q8_0: with the native kernels the engine
    multiplies the head by those blocks (the lookup reads them too) instead of a float32 copy (640 MiB read
    every decode step), with logits as the dequantized float32 model's (the exact path: summation order)."""
    from tokenloom.model.layers.quantized_weight import QuantizedWeight
    require_kernels()
    path = _write_gemma3_gguf(str(tmp_path / "tiny-gemma3-q8.gguf"), tiny_gemma_gguf[1], "Q8_0")
    core = _core(path, num_blocks=64)
    model = core.executor.worker.runner.model  # after the engine's set-up (matmul dtype, oneDNN prepacking)
    head = model.head_weight()
    assert isinstance(head, QuantizedWeight) and head.bits == 8 and head is model.model.embed_tokens.weight
    dense = load_model(path, torch.float32, torch.device("cpu"), progress=False, quantized=False).model
    got, want = helpers.last_logits(model, prompts), helpers.last_logits(dense, prompts)
    assert (got - want).abs().max().item() < LOGIT_TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- the real Gemma 3 270M file -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_file() -> str:
    return resolve_model_path("gemma3-270m")


def test_a_chat_request_to_a_model_without_a_chat_template_is_a_400(gemma_file):
    """The 270M base model's GGUF carries no chat template: the chat handler refuses in OpenAI's error shape
    before anything reaches the engine (which it reads the tokenizer from)."""
    from types import SimpleNamespace

    from tokenloom.entrypoints.openai.errors import BadRequestError
    from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
    tokenizer = Tokenizer.from_gguf(gemma_file)
    assert tokenizer.chat_template is None
    chat = OpenAIServingChat(SimpleNamespace(tokenizer=tokenizer), ["gemma3-270m"])
    request = ChatCompletionRequest(model="gemma3-270m", messages=[{"role": "user", "content": "Hello"}])
    with pytest.raises(BadRequestError) as caught:
        chat.render_prompt(request)
    body = caught.value.to_dict()["error"]
    assert caught.value.status_code == 400 and body["code"] == "no_chat_template"
    assert "/v1/completions" in body["message"]


@pytest.fixture(scope="module")
def hf_gemma(gemma_file):
    return helpers.load_hf_from_gguf(gemma_file)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_gguf_architecture_matches_the_one_transformers_reads(gemma_file, hf_gemma):
    """Slow (with the next test): transformers' own load of the file dequantizes every tensor, a 262,144-row
    embedding among them, and takes minutes on 2 busy cores."""
    ours = open_model_source(gemma_file, torch.float32).arch_config
    theirs = hf_gemma.config
    assert isinstance(ours, ArchConfig) and ours.architecture == "Gemma3ForCausalLM"
    assert ours.layer_types == theirs.layer_types and ours.sliding_window == theirs.sliding_window == 512
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
    assert ours.final_logit_softcapping == theirs.final_logit_softcapping
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (18, 4, 1, 256)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gemma3_270m_greedy_is_token_identical_to_transformers_past_the_512_token_window(gemma_file, hf_gemma):
    """A counting prompt of over 600 tokens (so local layers see only its end) and a short prose one,
    prefilled in 256-token chunks."""
    tokenizer = Tokenizer.from_gguf(gemma_file)
    texts = [", ".join(str(i) for i in range(1, 260)) + ",", "The capital of France is"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len(prompts[0]) > 600 and prompts[0][0] == 2  # <bos> first, as transformers' tokenizer adds
    core = _core("gemma3-270m", num_blocks=160, max_num_batched_tokens=256)
    got = helpers.generate_tokens(core, prompts, helpers.greedy_params(12))
    for prompt, tokens in zip(prompts, got):
        want = helpers.hf_greedy(hf_gemma, prompt, 12)
        assert tokens == want, helpers.describe_divergence(hf_gemma, prompt, tokens, want)
